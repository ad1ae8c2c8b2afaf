"""Accelerator kernels for the OSCAR packed KV cache.

`oscar_export.kernels.triton_oscar` holds the Triton kernels (quantize + pack, split-K decode
attention). Triton is optional (`pip install oscar-export[gpu]`), so nothing is imported here:
import the submodule explicitly. To run the kernels on CPU through Triton's interpreter, set
`TRITON_INTERPRET=1` before importing `oscar_export.kernels.triton_oscar` (the kernels are
compiled or interpreted when that module is imported).
"""
