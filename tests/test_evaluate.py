"""Quality evaluation: the one-pass runner gives what feeding the caches chunk by chunk gives (the same
stored values bit for bit, the same logits to float rounding), KIVI matches a by-hand computation, the
methods order as expected on constructed data, and the result, table, plot and CLI work."""

import argparse
import json
import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_export.cache import OscarKVCache
from oscar_export.sizes import bits_per_element as oscar_bits
from oscar_export.config import OscarConfig, OscarInputError
from oscar_export.evaluate.baselines import EvalOscarKVCache, Fp16Cache, KiviCache, OnlineOscarKVCache, bits_at, kivi_bits_per_element
from oscar_export.evaluate.driver import evaluate
from oscar_export.evaluate.methods import build_methods
from oscar_export.evaluate.metrics import attention_errors, needle_cases
from oscar_export.evaluate.one_pass import OnePass, chunk_bounds, one_pass_attention, one_pass_logits
from oscar_export.evaluate.specs import method_config
from oscar_export.evaluate.tables import plot, print_table
from model_checks import LOGITS_RTOL, logits_rel_error
from oscar_export.hf_cache import route_attention
from oscar_export.models import BUNDLED_MODEL_DIR
from oscar_export.calibration.rotations import hadamard_rotations

VOCAB = 128


class CharTokenizer:
    """One id per ASCII character; decode round-trips."""

    def __call__(self, text, **kwargs):
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)


def tiny_llama(seed=0, layers=2, max_positions=1024):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = "the of and to a in that is was he for it with as his on be at by had not are but from".split()
    text = " ".join(rng.choice(words) for _ in range(900))
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(text)
    return path


# -- the one-pass runner against feeding the cache chunk by chunk -------------------------------


@torch.no_grad()
def chunked_logits(model, ids, cache, chunk, first=None):
    """The reference: every chunk through cache.attend, each with its own positions."""
    with route_attention(model, cache):
        return torch.cat([model(input_ids=ids[None, n0:n1], position_ids=torch.arange(n0, n1)[None],
                                use_cache=False).logits[0] for n0, n1 in chunk_bounds(ids.shape[0], chunk, first)])


def orthogonal(gen, layers, d):
    """Signed permutations: their products are exact on any CPU, so values rotated per chunk and rotated
    for the whole sequence at once compare bit for bit (the normative boundary is the rotated fp16 vector)."""
    eye = torch.eye(d)
    return torch.stack([eye[torch.randperm(d, generator=gen)] * (torch.randint(0, 2, (d,), generator=gen) * 2 - 1)
                        for _ in range(layers)])


def caches(n):
    """A fresh cache of every kind, for n tokens of the tiny model (2 layers, 2 KV heads, head_dim 64)."""
    gen = torch.Generator().manual_seed(4)
    cfg = OscarConfig(sink=8, recent=24, cluster_dim=32)
    lloyd = OscarConfig(k_bits=3, v_bits=2, sink=8, recent=24, codebook="lloyd-max", k_clip=0.8, scale_dtype="bfloat16")
    levels = {b: torch.stack([torch.tensor([0.0, 0.9, 2.1, 3.0]) if b == 2 else torch.linspace(0, 7, 8)
                              + torch.tensor([0, .2, -.1, .3, 0, .1, -.2, 0])] * 2) for b in (2, 3)}
    return {
        "fp16": Fp16Cache(2, 2, 64, n),
        "kivi": KiviCache(cfg, 2, 2, 64, n),
        "naive": EvalOscarKVCache(cfg, 2, 2, 64, n),
        "rotated lloyd-max K3/V2": EvalOscarKVCache(lloyd, 2, 2, 64, n, orthogonal(gen, 2, 64), orthogonal(gen, 2, 64),
                                                  levels[3], levels[2]),
        "online": OnlineOscarKVCache(cfg, 2, 2, 64, n),
    }


@pytest.mark.parametrize("chunk, first", [(64, None), (37, 100), (1, 250)])
def test_one_pass_fp16_equals_plain_forward(tiny, chunk, first):
    ids = torch.randint(0, VOCAB, (260,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = tiny(input_ids=ids[None]).logits[0]
    exact = one_pass_logits(tiny, ids, Fp16Cache(2, 2, 64, 260, dtype=torch.float32), chunk, first)
    torch.testing.assert_close(exact, plain, atol=1e-5, rtol=0)
    fp16 = one_pass_logits(tiny, ids, Fp16Cache(2, 2, 64, 260), chunk, first)
    assert (fp16 - plain).abs().max() < 1e-3  # only K/V rounding to fp16
    assert tiny.config._attn_implementation != "oscar_eval"  # restored


@pytest.mark.parametrize("kind", ["fp16", "kivi", "naive", "rotated lloyd-max K3/V2", "online"])
@pytest.mark.parametrize("chunk, first", [(40, 64), (1, 33), (300, None)])
def test_one_pass_equals_the_chunked_cache(tiny, kind, chunk, first):
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(2))
    want = chunked_logits(tiny, ids, caches(300)[kind], chunk, first)
    got = one_pass_logits(tiny, ids, caches(300)[kind], chunk, first)
    # Float work upstream of the codes: chunks of another length go through GEMMs of another shape, which on
    # some float paths (MKL_CBWR=COMPATIBLE) round a K value to the neighbouring fp16 and move a code. Logits
    # are held to parity's relative bound (docs/format.md, 7); the stored values compare bit for bit below.
    assert logits_rel_error(got.numpy(), want.numpy()) <= LOGITS_RTOL
    last = one_pass_logits(tiny, ids, caches(300)[kind], chunk, first, keep_last=7)
    torch.testing.assert_close(last, got[-7:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["kivi", "naive", "rotated lloyd-max K3/V2", "online"])
def test_one_pass_reads_the_values_the_cache_stores(kind):
    """After feeding a sequence chunk by chunk, each position the cache holds (sink, body codes
    dequantized, recent window) equals the one-pass view's value for it, bit for bit; and the body a
    chunk reads ends where the cache's body ended before that chunk."""
    gen = torch.Generator().manual_seed(6)
    n, bounds = 290, chunk_bounds(290, 45, 32)
    q, k, v = torch.randn(4, n, 64, generator=gen), torch.randn(2, n, 64, generator=gen) * 3, \
        torch.randn(2, n, 64, generator=gen)
    k[:, :, 5] += 9  # an outlier channel
    fed, view = caches(n)[kind], caches(n)[kind]
    ends = []
    for n0, n1 in bounds:
        ends.append(fed.quantized_to[1] if kind == "kivi" else fed.config.sink + max(fed.length[1] - 8 - 24, 0))
        fed.attend(1, q[:, n0:n1], k[:, n0:n1], v[:, n0:n1])
    seq = view.sequence(1, q, k, v, bounds[0][1])
    assert [view.body_end(n0) for n0, _ in bounds] == ends
    end = view.body_end(n)  # the body after the whole sequence
    for name in ("k", "v"):
        stored = fed.stored(name, 1)
        sink = view.config.sink
        held = torch.cat([seq.window[name][:, :sink], seq.body[name][:, sink:end], seq.window[name][:, end:]], 1)
        if kind == "online":
            # Its rotation is estimated from data, and a product of a chunk with it may round differently from
            # the whole sequence's on another CPU: from the rotated fp16 vector on, count (docs/format.md, 7).
            assert float((stored != held).float().mean()) <= 1e-3, name
        else:
            torch.testing.assert_close(stored, held, rtol=0, atol=0)


def test_one_pass_blocks_of_queries_agree():
    gen = torch.Generator().manual_seed(8)
    n = 300
    q, k, v = torch.randn(4, n, 64, generator=gen), torch.randn(2, n, 64, generator=gen), torch.randn(2, n, 64, generator=gen)
    for kind in ("kivi", "rotated lloyd-max K3/V2"):
        cache = caches(n)[kind]
        seq = cache.sequence(0, q, k, v, 32)
        ends = torch.tensor([cache.body_end(n0) for n0, n1 in chunk_bounds(n, 45, 32) for _ in range(n0, n1)])
        whole = one_pass_attention(seq, ends, 0.125)
        for block in (1, 37, 128):
            torch.testing.assert_close(one_pass_attention(seq, ends, 0.125, block), whole, atol=1e-5, rtol=0)


def test_one_pass_rejects_a_chunk(tiny):
    target = OnePass(Fp16Cache(2, 2, 64, 50), chunk_bounds(50, 10))
    with pytest.raises(OscarInputError, match="whole sequence of 50"):
        target.attend(0, torch.zeros(4, 10, 64), torch.zeros(2, 10, 64), torch.zeros(2, 10, 64))


def test_method_specs():
    cfg = OscarConfig(sink=8)
    assert method_config("oscar", cfg) == ("oscar", cfg)
    name, c = method_config("oscar-3", cfg)
    assert (name, c.k_bits, c.v_bits, c.sink) == ("oscar", 3, 3, 8)
    name, c = method_config("kivi-k3v2", cfg)
    assert (name, c.k_bits, c.v_bits) == ("kivi", 3, 2)
    for bad in ("fp16-2", "oscar-5", "oscar-k3", "gptq", "oscar-"):
        with pytest.raises(OscarInputError, match="methods"):
            method_config(bad, cfg)


def test_window_nll_matches_model_loss(tiny, text_file):
    cfg = OscarConfig(sink=16, recent=32)
    result = evaluate("tiny", ["fp16"], config=cfg, contexts=(200,), text=text_file, metrics=("perplexity",),
                      ppl_tokens=200, chunk=48, calibration_tokens=64, calibration_heldout=32,
                      model=tiny, tokenizer=CharTokenizer())
    reserve = result["split"]["calibration_tokens"]
    ids = torch.tensor(CharTokenizer()(text_file.read_text())["input_ids"][reserve : reserve + 200])
    with torch.no_grad():
        loss = tiny(input_ids=ids[None], labels=ids[None]).loss
    assert result["methods"]["fp16"]["perplexity_by_context"]["200"] == pytest.approx(math.exp(loss), rel=1e-3)
    assert result["methods"]["fp16"]["bits_per_element"] == 16.0


# -- KIVI ----------------------------------------------------------------------------------------


def by_hand_int(x, bits):
    """Asymmetric INT over the last dim (one group), fp16 scale/zero, codes by threshold count."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).half().float()
    zero = lo.half().float()
    u = (x - zero) / torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.ceil(u - 0.5).clamp(0, 2**bits - 1)
    return zero + scale * torch.where(scale == 0, torch.zeros_like(codes), codes)


def by_hand_kivi_kv(k, v, n, sink, recent, group, bits):
    """What KIVI holds for the first n tokens of k, v [H, T, D], computed from the rule directly."""
    k, v = k[:, :n].half().float(), v[:, :n].half().float()
    k_out, v_out = k.clone(), v.clone()
    p = sink
    while p + group <= n - recent:  # a full block that left the recent window
        k_out[:, p : p + group] = by_hand_int(k[:, p : p + group].transpose(1, 2), bits).transpose(1, 2)
        v_blk = v[:, p : p + group]
        v_out[:, p : p + group] = by_hand_int(v_blk.reshape(*v_blk.shape[:2], -1, group), bits).flatten(-2)
        p += group
    return k_out, v_out, p - sink


@pytest.mark.parametrize("bits", [2, 3])
def test_kivi_matches_by_hand(bits):
    sink, recent, group = 5, 20, 32
    cfg = OscarConfig(k_bits=bits, v_bits=bits, cluster_dim=group, sink=sink, recent=recent)
    gen = torch.Generator().manual_seed(3)
    t, heads, kv_heads, d = 150, 4, 2, 64
    q = torch.randn(heads, t, d, generator=gen)
    k, v = torch.randn(kv_heads, t, d, generator=gen), torch.randn(kv_heads, t, d, generator=gen)
    k[:, :, 3] *= 10  # an outlier channel
    cache = KiviCache(cfg, 1, kv_heads, d, t)
    bounds = [0, 40, 90, 91, 92, 130, 150]
    for n0, n1 in zip(bounds, bounds[1:]):
        out = cache.attend(0, q[:, n0:n1], k[:, n0:n1], v[:, n0:n1])
        # by hand: the cache before the chunk, then the chunk at fp16, plain causal softmax attention
        k_old, v_old, quantized = by_hand_kivi_kv(k, v, n0, sink, recent, group, bits)
        keys = torch.cat([k_old, k[:, n0:n1].half().float()], 1).repeat_interleave(2, 0)
        values = torch.cat([v_old, v[:, n0:n1].half().float()], 1).repeat_interleave(2, 0)
        scores = q[:, n0:n1] @ keys.transpose(1, 2) / math.sqrt(d)
        scores = scores.masked_fill(torch.arange(n1)[None, :] > torch.arange(n0, n1)[:, None], -math.inf)
        torch.testing.assert_close(out, torch.softmax(scores, -1) @ values, atol=2e-5, rtol=1e-5)
        # the fp16 residual rule: exactly the full blocks past the recent window are quantized
        _, _, quantized = by_hand_kivi_kv(k, v, n1, sink, recent, group, bits)
        assert cache.quantized_to[0] - sink == quantized
        assert cache.bits_per_element() == pytest.approx(kivi_bits_per_element(cfg, d, n1))
    assert cache.quantized_to[0] == sink + 3 * group  # 150 - 20 - 5 = 125 tokens past the window: 3 blocks
    torch.testing.assert_close(cache.stored("k", 0)[:, 120:], k[:, 120:].half().float())  # residual + window in fp16


def test_kivi_bits_accounting():
    cfg = OscarConfig(cluster_dim=64, sink=64, recent=256)
    # long context: K per channel 2 + 32/64, V per token 2 + 32/64 bits, as OSCAR's 2.5-bit body
    assert kivi_bits_per_element(cfg, 64, 64 + 256 + 64 * 10_000) == pytest.approx(
        oscar_bits(cfg, 64, 64 + 256 + 64 * 10_000))
    assert kivi_bits_per_element(cfg, 64, 320) == 16.0
    assert kivi_bits_per_element(cfg, 64, 383) == 16.0  # an incomplete block stays fp16


# -- method ordering on constructed data ---------------------------------------------------------


def outlier_qkv(layers=2, tokens=256, heads=4, kv_heads=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = {}
    for layer in range(layers):
        q = torch.randn(heads, tokens, d, generator=gen)
        k = torch.randn(kv_heads, tokens, d, generator=gen)
        v = torch.randn(kv_heads, tokens, d, generator=gen)
        k[:, :, 7] = 20 + torch.randn(kv_heads, tokens, generator=gen)  # a large-offset outlier channel
        q[:, :, 7] *= 0.05
        qkv[layer] = (q, k, v)
    return qkv


def test_method_ordering_with_an_outlier_channel(tiny):
    cfg = OscarConfig(sink=4, recent=16)
    qkv = outlier_qkv()
    methods = {m.name: m for m in build_methods(tiny, None, ["fp16", "naive", "hadamard", "kivi", "online"], cfg)}
    err = {name: sum(attention_errors(qkv, m.make, 16)) for name, m in methods.items()}
    assert err["fp16"] < 1e-3
    assert err["hadamard"] < err["naive"]
    assert err["kivi"] < err["naive"]  # per-channel K absorbs the outlier channel
    assert err["online"] < err["naive"]
    # and more bits, less error
    cfg3 = OscarConfig(k_bits=3, v_bits=3, sink=4, recent=16)
    naive3 = build_methods(tiny, None, ["naive"], cfg3)[0]
    assert sum(attention_errors(qkv, naive3.make, 16)) < err["naive"]


def test_bits_are_the_bytes_the_caches_hold():
    cfg = OscarConfig(sink=8, recent=16, cluster_dim=32)
    for cache in (OscarKVCache(cfg, 1, 2, 64, 100), KiviCache(cfg, 1, 2, 64, 100), Fp16Cache(1, 2, 64, 100)):
        cache.attend(0, torch.randn(4, 100, 64), torch.randn(2, 100, 64), torch.randn(2, 100, 64))
        assert bits_at(cache, 100) == pytest.approx(cache.nbytes * 8 / (2 * 100 * 2 * 64)), type(cache).__name__


def test_needle_cases_layout():
    ids = torch.arange(2000)
    depths = (0.0, 0.5, 1.0)
    cases = needle_cases(ids, context=200, needle_tokens=24, prefix=8, depths=depths, seeds=2)
    controls = needle_cases(ids, context=200, needle_tokens=24, prefix=8, depths=depths, seeds=2, control=True)
    assert len(cases) == len(controls) == 2
    span = 200 + 3 * 24
    for case, control in zip(cases, controls):
        seq = case.ids
        assert seq.shape[0] == control.ids.shape[0] == span + 3 * 24
        repeats = [seq[span + i * 24 : span + (i + 1) * 24] for i in range(3)]
        for i, (depth, needle) in enumerate(zip(depths, repeats)):
            pos = round(depth * 200) + i * 24  # earlier needles shift it
            assert torch.equal(seq[pos : pos + 24], needle)
            assert case.answers[depth] == (span + i * 24 + 8, span + (i + 1) * 24)
        hay = [t for t in seq[:span].tolist() if t not in set(torch.cat(repeats).tolist())]
        assert len(hay) == 200  # the haystack and the needles are disjoint spans
        assert hay == list(range(hay[0], hay[0] + 200))  # one contiguous haystack around the needles
        # The control: the same repeats after a haystack continued where the needles were.
        assert torch.equal(control.ids[span:], seq[span:]) and control.answers == case.answers
        assert control.ids[:span].tolist() == list(range(hay[0], hay[0] + span))
        assert not set(control.ids[:span].tolist()) & set(torch.cat(repeats).tolist())
    with pytest.raises(OscarInputError, match="needle_prefix"):
        needle_cases(ids, 200, 24, 24, depths, 1)
    with pytest.raises(OscarInputError, match="at least"):
        needle_cases(torch.arange(300), 200, 24, 8, depths, 1)


# -- the whole evaluation ------------------------------------------------------------------------


SMALL = dict(contexts=(128, 192), chunk=32, ppl_tokens=192, attn_tokens=96, decode_tokens=8, needle_context=96,
             needle_depths=(0.2, 0.8), needle_seeds=1, calibration_tokens=256, calibration_heldout=64)


@pytest.fixture(scope="module")
def small_result(tiny, text_file):
    cfg = OscarConfig(sink=16, recent=32)
    return evaluate("tiny", ["fp16", "naive", "hadamard", "kivi", "oscar", "online"], config=cfg,
                    text=text_file, model=tiny, tokenizer=CharTokenizer(), **SMALL)


def test_result_has_the_required_keys(small_result):
    result = json.loads(json.dumps(small_result))  # plain JSON
    assert {"model", "bits", "config", "methods"} <= set(result)
    assert result["bits"] == 2 and result["config"]["sink"] == 16
    assert list(result["methods"]) == ["fp16", "naive", "hadamard", "kivi", "oscar", "online"]
    for name, r in result["methods"].items():
        for key in ("perplexity", "perplexity_by_context", "attention_error", "attention_error_by_layer",
                    "bits_per_element", "needle_accuracy", "needle_by_depth"):
            assert key in r, (name, key)
        assert set(r["perplexity_by_context"]) == {"128", "192"}
        assert r["perplexity"] == pytest.approx(sum(r["perplexity_by_context"].values()) / 2)
        assert len(r["attention_error_by_layer"]) == 2
        assert set(r["needle_by_depth"]) == {"0.2", "0.8"}
        assert 0 <= r["needle_accuracy"] <= 1
    assert 0 <= result["needle_control_accuracy"] <= 1
    m = result["methods"]
    assert m["fp16"]["bits_per_element"] == 16
    assert m["naive"]["bits_per_element"] == pytest.approx(oscar_bits(OscarConfig(sink=16, recent=32), 64, 192))
    assert m["kivi"]["bits_per_element"] == pytest.approx(kivi_bits_per_element(OscarConfig(sink=16, recent=32), 64, 192))
    assert m["oscar"]["rotation"] == "calibrated"
    assert m["fp16"]["attention_error"] < m["naive"]["attention_error"]


def test_rotation_file_is_used(tiny, text_file, tmp_path):
    from oscar_export.calibration.files import RotationSet, save_rotations

    rot = hadamard_rotations(2, 64)
    path = tmp_path / "rot.safetensors"
    save_rotations(path, RotationSet(k=rot, v=rot.clone(), metadata={"codebook": "uniform"}))
    cfg = OscarConfig(k_bits=3, v_bits=3, sink=16, recent=32)
    small = {**SMALL, "contexts": (128,)}
    result = evaluate("tiny", ["hadamard", "oscar"], config=cfg, rotations=path, text=text_file,
                      model=tiny, tokenizer=CharTokenizer(), **small)
    h, o = result["methods"]["hadamard"], result["methods"]["oscar"]
    assert result["bits"] == 3 and o["rotation"] == f"file {path}"
    assert o["perplexity"] == h["perplexity"] and o["attention_error"] == h["attention_error"]
    # the file's clip ratios apply to oscar; match_clip gives them to the baselines as well
    save_rotations(path, RotationSet(k=rot, v=rot.clone(), metadata={"codebook": "uniform", "k_clip": 0.9, "v_clip": 0.85}))
    for match in (False, True):
        result = evaluate("tiny", ["hadamard", "oscar"], config=cfg, rotations=path, text=text_file,
                          model=tiny, tokenizer=CharTokenizer(), metrics=("attention",), match_clip=match, **small)
        h, o = result["methods"]["hadamard"], result["methods"]["oscar"]
        assert (o["config"]["k_clip"], o["config"]["v_clip"]) == (0.9, 0.85)
        assert h["config"]["k_clip"] == (0.9 if match else 1.0)
        assert (o["attention_error"] == h["attention_error"]) == match
    with pytest.raises(OscarInputError, match="match_clip"):
        evaluate("tiny", ["hadamard"], config=cfg, text=text_file, model=tiny, tokenizer=CharTokenizer(),
                 metrics=("attention",), match_clip=True, **small)


@pytest.mark.parametrize("per_head", [False, True])
def test_calibrated_oscar_per_kv_head(tiny, text_file, per_head):
    """per_head fits one rotation per KV head, and they differ between the heads (each has its own data)."""
    text = text_file.read_text()
    (method,) = build_methods(tiny, CharTokenizer(), ["oscar"], OscarConfig(sink=16, recent=32), calibration_text=text,
                              calibration_tokens=256, calibration_heldout=64, per_head=per_head)
    k = method.make(64).rotation["k"]  # the cache holds one per (layer, KV head) either way
    assert k.shape == (2, 2, 64, 64)
    assert torch.allclose(k[1, 1] @ k[1, 1].T, torch.eye(64), atol=1e-4)
    assert ((k[:, 0] - k[:, 1]).abs().max() > 1e-3) == per_head


def test_table_and_plot(small_result, tmp_path, capsys):
    from rich.console import Console

    print_table(small_result, Console(width=200))
    out = capsys.readouterr().out
    assert "kivi" in out and "ppl@192" in out and "needle acc" in out
    path = plot(small_result, tmp_path / "eval.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(methods=["fp16", "gptq"]), "methods"),
        (dict(contexts=(4096,)), "max_position_embeddings"),
        (dict(text="/no/such/file.txt"), "/no/such/file.txt"),
        (dict(chunk=0), "chunk"),
        (dict(rotations="/no/such/rot.safetensors", methods=["oscar"]), "/no/such/rot.safetensors"),
    ],
)
def test_bad_input_names_it(tiny, text_file, kwargs, needle):
    args = {**SMALL, "text": text_file, **kwargs}
    with pytest.raises(OscarInputError, match=needle.replace(".", r"\.")):
        evaluate("tiny", **{"methods": ["fp16"], **args}, model=tiny, tokenizer=CharTokenizer())


def test_plot_refuses_a_missing_directory(small_result):
    with pytest.raises(OscarInputError, match="plot file"):
        plot(small_result, "/no/such/dir/eval.png")


# -- the command ---------------------------------------------------------------------------------


def eval_parser():
    from oscar_export.cli.eval import add_eval_command

    parser = argparse.ArgumentParser(prog="oscar-export")
    add_eval_command(parser.add_subparsers(dest="command"))
    return parser


def test_cli_parses_and_names_bad_input(tmp_path):
    parser = eval_parser()
    args = parser.parse_args(["eval", "--model", "/no/such/model", "--bits", "3", "--methods", "fp16,kivi",
                              "--json", "--plot", str(tmp_path / "p.png")])
    assert args.bits == 3 and args.json and args.methods == "fp16,kivi"
    with pytest.raises(OscarInputError, match="/no/such/model"):
        args.func(args)
    for flag, value in (("--methods", "fp16,bogus"), ("--methods", "fp16,fp16"), ("--contexts", "512,x"),
                        ("--needle-depths", "2")):
        args = parser.parse_args(["eval", flag, value])
        with pytest.raises(OscarInputError, match=flag):
            args.func(args)


@pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "model.safetensors").is_file(), reason="bundled model not present")
def test_cli_on_the_bundled_model(tmp_path, capsys):
    parser = eval_parser()
    png = tmp_path / "eval.png"
    args = parser.parse_args(["eval", "--methods", "fp16,kivi,oscar", "--contexts", "384", "--ppl-tokens", "384",
                              "--attn-tokens", "352", "--needle-context", "320", "--needle-depths", "0.2",
                              "--needle-seeds", "1", "--calibration-tokens", "512", "--json", "--plot", str(png)])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "bundled" and result["bits"] == 2
    m = result["methods"]
    assert m["oscar"]["rotation"] == "calibrated"
    # 64 sink + 256 recent of 384 tokens: 64 body tokens, one full KIVI block
    assert m["oscar"]["bits_per_element"] == pytest.approx(m["kivi"]["bits_per_element"])
    assert m["fp16"]["perplexity"] < 300 and m["fp16"]["attention_error"] < 1e-2
    assert png.stat().st_size > 10_000
