import os

# Triton kernels run through the interpreter on machines without a GPU; the flag must be set
# before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
