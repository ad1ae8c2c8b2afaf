"""The fuzz harness (tests/fuzz_inputs.py), a bounded share: damaged inputs are refused in one line, never a
traceback, a crash, a silent pass or a user's entry lost. Many more cases on demand: python tests/fuzz_inputs.py --cases 2000."""

import pytest

from fuzz_inputs import BAD, OUTCOMES, run
from oscar_export.native import ort_op_buildable

CASES, NATIVE_CASES = 60, 6


@pytest.mark.skipif(not ort_op_buildable(), reason="the laptop artifact needs cmake, g++ and ONNX Runtime headers")
def test_damaged_inputs_are_refused_never_crash(tmp_path):
    from oscar_export.export.pipeline import export_artifact
    from oscar_export.targets import get

    artifact = tmp_path / "artifact"
    export_artifact(get("laptop"), "bundled", artifact, "hadamard", 256, float_weights=True)
    results = run(CASES, seed=0, artifact=artifact, tmp=tmp_path, native_cases=NATIVE_CASES)
    for family, counts in results.items():
        print(f"{family}: " + ", ".join(f"{key} {counts.get(key, 0)}" for key in OUTCOMES))
        assert not {key for key in BAD if counts.get(key)}, (family, dict(counts))
        assert counts["refused"] > 0, family  # the harness really damaged something
    assert results["C API"]["accepted"] > 0  # valid calls ran the kernels too
