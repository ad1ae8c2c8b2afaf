"""Export to on-device runtimes: the shared graph (graph.py) and the ONNX Runtime target."""
