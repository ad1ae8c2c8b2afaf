"""The OSCAR attention op: its definition and reference (attention.py), and its lowerings to ONNX
(onnx.py) and to Core ML's standard ops (coreml.py). The native kernels live in runtime_ops/."""
