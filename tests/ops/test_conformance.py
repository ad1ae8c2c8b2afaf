"""Every backend of oscar::attention (tests/backends.py) replays every golden vector case, under the same checks.

Each output chunk must be within the backend's tolerance of the reference's (native_cases.rel_err), and the
final cache must equal the reference's bit for bit, dtype included. A backend whose runtime is unavailable here
skips and says why.
"""

import pytest

from backends import BACKENDS, replay
from native_cases import assert_final_cache, golden_case

pytestmark = pytest.mark.usefixtures("single_threaded")


@pytest.mark.parametrize("backend,name", [pytest.param(backend, name, id=f"{backend.name}-{name}")
                                          for backend in BACKENDS for name in backend.cases])
def test_backend_replays_the_golden_vectors(backend, name):
    missing = backend.missing()
    if missing:
        pytest.skip(f"{backend.name}: {missing}")
    case = golden_case(name)
    worst, cache = replay(backend, case)
    assert worst <= backend.tolerance, f"{backend.name} on {name}: attention relative error {worst:.3g}"
    dtypes = {region: (cache[region].dtype, want.dtype) for region, want in case.final.items()}
    assert all(got == want for got, want in dtypes.values()), f"{backend.name} on {name}: cache dtypes {dtypes}"
    assert_final_cache(case, cache)
