"""`bench decode --runtime executorch`: the baselines with ExecuTorch's own caches compute the model, their
programs decode like their eager graphs from the bench's kind of state, and bad input is a one-line error."""

import numpy as np
import pytest
import torch

pytest.importorskip("executorch.extension.pybindings.portable_lib")

from oscar_export.cli import main  # noqa: E402
from oscar_export.config import OscarConfig  # noqa: E402
from oscar_export.models import BUNDLED_MODEL_DIR, load_model  # noqa: E402
from oscar_export.bench.et_decode import (EtCacheLM, EtCacheProgram,  # noqa: E402
                                                          export_et_cache)

CAPACITY, LENGTH = 512, 400


@pytest.fixture(scope="module")
def bundled():
    return load_model("bundled")


@pytest.mark.parametrize("kind, tolerance", [("fp32", 1e-5), ("int8", 1e-2)])
def test_executorch_cache_graph_decodes_like_transformers(bundled, kind, tolerance):
    """The baseline graph with float weights, after a real prompt and for three greedy steps, against transformers
    with its own fp32 cache. Tolerances, relative to the largest logit: fp32 float summation order (measured
    9e-7); int8 the per-token rounding of the cache and the query (measured 1.4e-3)."""
    model, tokenizer = bundled
    ids = tokenizer((BUNDLED_MODEL_DIR / "heldout.txt").read_text()[:2000])["input_ids"][:60]
    module = EtCacheLM(model, OscarConfig(), kind, 128).eval()
    with torch.no_grad():
        got = module(torch.tensor([ids]), torch.tensor([0]))[0, -1]
        for step in range(4):
            want = model(torch.tensor([ids])).logits[0, -1]
            assert (got - want).abs().max() <= tolerance * want.abs().max(), f"step {step}"
            if kind == "fp32":
                assert int(got.argmax()) == int(want.argmax())
            ids.append(int(want.argmax()))
            got = module(torch.tensor([ids[-1:]]), torch.tensor([len(ids) - 1]))[0, -1]


@pytest.mark.usefixtures("single_threaded")
def test_int8_program_from_a_synthetic_state_decodes_like_its_eager_graph(bundled, tmp_path):
    """The int8 baseline as the bench builds it (float weights here), filled with a synthetic state through the
    program's aliased buffers, against its eager graph holding copies of that state. Tolerance: XNNPACK's and
    torch's float summation orders, amplified where they move a per-token int8 rounding of q or the new K/V:
    1e-3 of the largest logit."""
    names = export_et_cache("bundled", OscarConfig(), "int8", CAPACITY, tmp_path / "int8.pte", float_weights=True)
    assert len(names) == 6 * bundled[0].config.num_hidden_layers  # codes, scales, zero points for K and V
    program = EtCacheProgram(tmp_path / "int8.pte", names)
    before = {name: array.copy() for name, array in program.writable_cache().items()}
    program.fill_synthetic(LENGTH, np.random.default_rng(0))
    module = EtCacheLM(bundled[0], OscarConfig(), "int8", CAPACITY).eval()
    buffers = dict(module.named_buffers())
    for name, array in program.writable_cache().items():
        assert (array[:, :LENGTH] != before[name][:, :LENGTH]).mean() > 0.5, name  # the state reached the program
        assert np.array_equal(array[:, LENGTH:], before[name][:, LENGTH:]), name  # only its cached rows
        buffers[name].copy_(torch.from_numpy(array.copy()))
    token = 7
    for step in range(3):
        got = program.step(token)
        with torch.no_grad():
            want = module(torch.tensor([[token]]), torch.tensor([LENGTH + step]))[0, -1].numpy()
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), f"step {step}"
        token = int(want.argmax())


def test_context_too_small_is_a_one_line_error(capsys):
    assert main(["bench", "decode", "--runtime", "executorch", "--context", "300", "--steps", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--context 300" in err and "334" in err
