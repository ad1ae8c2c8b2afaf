"""The android target: model.pte for ExecuTorch (XNNPACK for the dense layers, the native
oscar::attention kernel over a packed cache kept in the program's mutable buffers).

Directory contents: model.pte, liboscar_executorch.so (the kernel library for this machine),
native/ (the C++ sources of the kernel and core, a CMake snippet, for an app's NDK build), the
tokenizer files, the rotation file when one was used, and manifest.json. lower.py writes them,
runner.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...config import OscarInputError
from .. import Lowered, Target, TargetOptions, register


@dataclass(frozen=True)
class AndroidOptions(TargetOptions):
    max_chunk: int = 256  # the stock runner splits longer prompts into chunks of get_max_seq_len
    group_size: int = 32  # input channels per 4-bit weight group (--group-size)


class AndroidTarget(Target):
    name = "android"
    runtime = "executorch"
    description = ("model.pte for ExecuTorch (XNNPACK dense layers, the native OSCAR kernel over a packed cache in "
                   "mutable buffers), the kernel library and its C++ sources for an NDK build, tokenizer and "
                   "manifest.json")
    options = AndroidOptions()
    packages = ("oscar-export", "torch", "transformers", "executorch", "torchao")
    runtimes = {"executorch": "ExecuTorch pybindings with the native kernel library",
                "stock-runner": "ExecuTorch's C++ TextLLMRunner, as an Android app runs it (tokens only)"}
    float_weights_help = "keep float weights (default: 4-bit grouped weights, 8-bit dynamic activations)"
    streams_weights = True

    def add_export_flags(self, parser):
        parser.add_argument("--group-size", type=int, default=self.options.group_size,
                            help="input channels per 4-bit weight group (default %(default)s)")

    def export_options(self, args):
        if args.group_size <= 0:
            raise OscarInputError(f"--group-size {args.group_size}: expected a positive channel count")
        return replace(self.options, group_size=args.group_size)

    def weight_plan(self, options, float_weights):
        # XNNPACK's 4-bit weights are symmetric: a scale, no zero point.
        return dict(weight_bits=16 if float_weights else 4, weight_group=options.group_size, weight_zero_points=False)

    def lower(self, module, model, tokenizer, max_context, max_chunk, float_weights, options,
              weights=None) -> Lowered:
        from .lower import lower_artifact

        return lower_artifact(module, model, tokenizer, max_context, max_chunk, float_weights, options.group_size,
                              weights)

    def program_io(self, directory):
        from .runner import program_io

        return program_io(directory)

    def runner(self, directory, manifest, runtime, threads):
        from .runner import EtLM

        if runtime != "executorch":
            raise OscarInputError(f"runtime {runtime!r} has no step-by-step runner: expected 'executorch'")
        return EtLM(directory, threads, manifest["max_chunk"])

    def generate(self, directory, manifest, runtime, tokenizer, prompt, ids, max_new_tokens, threads):
        if runtime == "stock-runner":
            from .runner import stock_runner_generate

            return stock_runner_generate(directory, prompt, max_new_tokens, threads)
        return super().generate(directory, manifest, runtime, tokenizer, prompt, ids, max_new_tokens, threads)

    def artifact_module(self, directory, manifest, module=None):
        """The eager graph with the artifact's weights: the same torchao 4-bit quantization of the source
        checkpoint, which is deterministic, so these are the weights the program holds."""
        module = super().artifact_module(directory, manifest, module)
        if manifest["weights"] != "float32":
            from .lower import quantize_artifact_weights

            quantize_artifact_weights(module, manifest.get("group_size", self.options.group_size))
        return module

    def parity_limits(self, manifest):
        # With 4-bit weights the activations are quantized to 8 bits on the fly, by XNNPACK in the program and by
        # torchao's eager kernels in the reference: float differences upstream flip some activation codes, so the
        # K/V entering the op differ by more than ties and more body codes may differ (measured with 200 prompt
        # tokens, sink 16: 7e-5 on the bundled model, 5.2e-4 on SmolLM2).
        return {"codes_mismatch_fraction": 5e-3} if self.rounds_activations(manifest) else {}

    def rounds_activations(self, manifest):
        return manifest["weights"] != "float32"  # 4-bit weights take 8-bit dynamic activations

    def trace(self, directory, manifest, runtime, ids, steps, forced=None):
        if runtime != "stock-runner":
            return super().trace(directory, manifest, runtime, ids, steps, forced)
        from .runner import stock_runner_generate

        from ...export.artifact import artifact_tokenizer, prompt_ids

        # The C++ runner tokenizes text itself and returns pieces: it is compared on its own greedy tokens alone
        # (it cannot be fed others), and only on a prompt whose text tokenizes back to the same ids.
        tokenizer = artifact_tokenizer(directory)
        text = tokenizer.decode(ids)
        if prompt_ids(tokenizer, text) != list(ids):
            return {"skipped": "the prompt's text does not tokenize back to the same ids, and this runner takes text"}
        got = stock_runner_generate(directory, text, steps)
        return {"tokens": got["tokens"], "logits": None, "codes": None}


register(AndroidTarget())
