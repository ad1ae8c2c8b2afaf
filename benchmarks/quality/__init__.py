"""Cache-format quality on SmolLM2: each lever against fp16 at the bits it costs."""
