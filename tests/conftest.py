import os

import pytest

# Triton kernels run through the interpreter on machines without a GPU; the flag must be set
# before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def calibration_cache(tmp_path_factory):
    """Calibrations made by the tests (--rotations calibrate with non-default flags) stay out of the user's cache;
    subprocesses inherit the variable."""
    os.environ["OSCAR_EXPORT_CACHE"] = str(tmp_path_factory.mktemp("calibrations"))


@pytest.fixture(scope="module")
def single_threaded():
    """One torch thread for a module (pytestmark = pytest.mark.usefixtures("single_threaded")): its tensors are
    small, and more threads spin-wait in OpenMP on busy cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Files that take minutes (whole-model exports in their module fixtures), longest first. scripts/test.sh runs files
# in parallel workers in collection order: these are handed out first, so none starts last and runs alone.
LONG_FILES = ("targets/test_ios.py", "targets/test_android.py", "test_smollm2.py", "targets/test_laptop.py",
              "runtime_ops/test_et_ops.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: every file keeps its own order
