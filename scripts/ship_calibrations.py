"""Writes the calibrations the bundled model ships beside its weights, so set-up and tests reuse them: the one for
the cache flags' defaults (2-bit, the default group, K rounded as calibrated) and, per target, the one its export
without format flags chooses for its default device and context. Run after retraining the bundled model:
    .venv/bin/python scripts/ship_calibrations.py"""

from oscar_export.calibration.cached import CALIBRATED_K_ROUNDING, SHIPPED_FILES, calibrated_rotations
from oscar_export.config import OscarConfig, default_cluster_dim
from oscar_export.evaluate.budget import device_calibration
from oscar_export.export.artifact import default_context
from oscar_export.models import BUNDLED_MODEL_DIR, model_shape
from oscar_export.planner import parse_bytes
from oscar_export.targets import registry

shape = model_shape("bundled")
for old in BUNDLED_MODEL_DIR.glob(SHIPPED_FILES):
    old.unlink()  # recalibrate even where an old file still matches
# The format the cache flags' defaults calibrate for (cli.flags.calibration_config).
flags_default = OscarConfig(cluster_dim=default_cluster_dim(shape.head_dim), k_rounding=CALIBRATED_K_ROUNDING)
print("wrote", calibrated_rotations("bundled", flags_default, store=BUNDLED_MODEL_DIR / "calibration.safetensors")[0])
for target in registry().values():
    options = target.options
    path, reused, choice = device_calibration(
        "bundled", shape, parse_bytes(options.device_memory), default_context(shape, None),
        target.weight_plan(options, False), target.scale_dtypes, target.min_window,
        # a later target whose choice is the same reuses the file of the first
        store=BUNDLED_MODEL_DIR / f"calibration-{target.name}.safetensors")
    print(target.name, "reused" if reused else "wrote", path, choice)
