"""calibrate --budget-bits: the candidates fit the budget, the chosen format is the best scored one, and the
rotation file carries it into export, eval and plan."""

import json
import math

import pytest
import torch

from oscar_export.calibration.cached import run_calibration
from oscar_export.cli import main
from oscar_export.config import SUPPORTED_BITS, SUPPORTED_CLUSTER_DIMS, OscarConfig, OscarInputError
from oscar_export.config import config_for
from oscar_export.models import BUNDLED_MODEL_DIR, load_model, model_shape
from oscar_export.planner import cache_budget_bits, plan
from oscar_export.calibration.files import load_rotations
from oscar_export.evaluate.budget import (
    PROBE_DEPTHS,
    format_chooser,
    PROBE_PREFIX,
    PROBE_TOKENS,
    MIXED_SHORTLIST,
    SHORTLIST,
    WIDER_CLIPS,
    WINDOWS,
    candidates,
    cheapest_format,
    device_budget,
    mixed_candidates,
    retrieval_probe,
    wider_clips,
)

pytestmark = pytest.mark.usefixtures("single_threaded")


def stored_bits(k_bits, v_bits, cluster_dim, sink, recent, head_dim, context, scale_bits=16):
    """Bits per K/V element, counted by hand: fp16 windows, then per body vector its codes and a scale and zero
    of scale_bits per group, for K and for V."""
    windows = min(context, sink + recent)
    body = context - windows
    per_vector = sum(head_dim * b + 2 * scale_bits * head_dim // cluster_dim for b in (k_bits, v_bits))
    return (windows * 2 * head_dim * 16 + body * per_vector) / (context * 2 * head_dim)


@pytest.mark.parametrize("budget, context, head_dim", [(3.0, 8192, 64), (2.4, 32768, 128), (4.5, 2048, 64)])
def test_candidates_are_every_format_within_the_budget_with_the_largest_windows(budget, context, head_dim):
    found = {(c.config.k_bits, c.config.v_bits, c.config.cluster_dim): c for c in candidates(budget, context, head_dim)}
    for k in SUPPORTED_BITS:
        for v in SUPPORTED_BITS:
            for cd in (cd for cd in SUPPORTED_CLUSTER_DIMS if head_dim % cd == 0):
                fitting = [w for w in WINDOWS if stored_bits(k, v, cd, *w, head_dim, context) <= budget]
                if not fitting:
                    assert (k, v, cd) not in found
                    continue
                c = found[(k, v, cd)]
                assert (c.config.sink, c.config.recent) == fitting[0]  # the largest windows that fit
                assert c.bits == pytest.approx(stored_bits(k, v, cd, *fitting[0], head_dim, context))


# head_dim 64 (SmolLM2) has no groups of 128, so even 2.4 bits at 32K is out of its reach.
@pytest.mark.parametrize("head_dim, group, budget", [(128, 128, 2.0), (64, 64, 2.4)])
def test_a_budget_nothing_fits_names_the_cheapest(head_dim, group, budget):
    sink, recent = WINDOWS[-1]
    cheapest = stored_bits(2, 2, group, sink, recent, head_dim, 32768)  # 2-bit, largest group, smallest windows
    with pytest.raises(OscarInputError, match=rf"--budget-bits {budget:g}: no cache format fits .* at least "
                       rf"{cheapest:.3f} bits per element \(K2/V2, group {group}, sink {sink}, recent {recent}; a "
                       rf"group is at most head_dim={head_dim} elements\)"):
        candidates(budget, 32768, head_dim)


def test_fp8_scales_bring_the_long_context_budget_within_reach():
    """2.4 bits at 32K, out of head_dim 64's reach with fp16 scales (above), fits with fp8 ones: K2/V2, group 64."""
    found = candidates(2.4, 32768, 64, scale_dtype="float8_e4m3fn")
    assert found and all(c.config.scale_dtype == "float8_e4m3fn" for c in found)
    k2v2 = next(c for c in found if (c.config.k_bits, c.config.v_bits, c.config.cluster_dim) == (2, 2, 64))
    fitting = [w for w in WINDOWS if stored_bits(2, 2, 64, *w, 64, 32768, scale_bits=8) <= 2.4]
    assert (k2v2.config.sink, k2v2.config.recent) == fitting[0]
    assert k2v2.bits == pytest.approx(stored_bits(2, 2, 64, *fitting[0], 64, 32768, scale_bits=8))


def test_a_budget_files_scale_dtype_is_part_of_its_format():
    meta = {"budget_bits": 2.4, "k_bits": 2, "v_bits": 2, "cluster_dim": 64, "sink": 64, "recent": 256,
            "k_clip": 0.85, "v_clip": 0.7, "scale_dtype": "float8_e4m3fn"}
    assert config_for(meta, 64).scale_dtype == "float8_e4m3fn"
    # Without a budget the file's format is not applied: its scale dtype only says how its clips were searched.
    plain = {key: value for key, value in meta.items() if key != "budget_bits"}
    assert config_for(plain, 64).scale_dtype == "float16"


@pytest.fixture(scope="module")
def budget_file(tmp_path_factory):
    model, tokenizer = load_model("bundled")
    rs, _ = run_calibration("bundled", OscarConfig(), BUNDLED_MODEL_DIR / "heldout.txt", 1024, 256, model=model,
                            tokenizer=tokenizer, choose=format_chooser(3.2, 1024, 64))
    path = tmp_path_factory.mktemp("tune") / "budget.safetensors"
    from oscar_export.calibration.files import save_rotations

    save_rotations(path, rs)
    return path


def test_the_chosen_format_fits_and_scored_best(budget_file):
    meta = load_rotations(budget_file).metadata
    assert meta["budget_bits"] == 3.2 and meta["budget_context"] == 1024
    assert meta["bits_per_element"] <= 3.2
    widths = meta.get("k_bits_by_layer") or [meta["k_bits"]]
    assert meta["bits_per_element"] == pytest.approx(  # a mixed-K format: the mean of its layers' one-width costs
        sum(stored_bits(k, meta["v_bits"], meta["cluster_dim"], meta["sink"], meta["recent"], 64, 1024)
            for k in widths) / len(widths))
    considered = meta["budget_candidates"]
    assert all(c["bits"] <= 3.2 for c in considered)
    uniform = [c for c in considered if c["k_bits_by_layer"] is None]
    mixed = [c for c in considered if c["k_bits_by_layer"] is not None]
    scored = [c for c in uniform if c["perplexity"] is not None and c["attention_error"] is not None]
    clipped = [c for c in uniform if c["attention_error"] is None]  # the shortlist winner at wider K clips
    assert 1 <= len(scored) <= SHORTLIST and len(mixed) <= MIXED_SHORTLIST * (max(SUPPORTED_BITS) - 2)
    # The shortlist is the lowest attention errors; the winner has the lowest perplexity of it, its clip variants
    # and the mixed ones.
    cutoff = max(c["attention_error"] for c in scored)
    assert all(c["attention_error"] >= cutoff for c in uniform if c["perplexity"] is None)
    first = min(scored, key=lambda c: c["perplexity"])
    same_format = ("k_bits", "v_bits", "cluster_dim", "sink", "recent", "v_clip")
    assert [c["k_clip"] for c in clipped] == wider_clips(first["k_clip"]) and len(clipped) <= WIDER_CLIPS
    assert all(all(c[k] == first[k] for k in same_format) for c in clipped)
    best = min(scored + clipped + mixed, key=lambda c: c["perplexity"])
    assert all(math.isfinite(c["perplexity"]) for c in scored + clipped + mixed)
    assert (meta["k_bits"], meta["v_bits"], meta["cluster_dim"], meta["sink"], meta["recent"],
            meta.get("k_bits_by_layer")) == \
        (best["k_bits"], best["v_bits"], best["cluster_dim"], best["sink"], best["recent"], best["k_bits_by_layer"])
    # Mixed candidates widen K on the best one-width format's widths and group, to one wider width each; at one
    # width, more wider layers contain fewer (one ranking, taken from the top).
    by_width = {}
    for c in mixed:
        wide = {i for i, b in enumerate(c["k_bits_by_layer"]) if b > c["k_bits"]}
        assert len({c["k_bits_by_layer"][i] for i in wide}) == 1 and c["k_bits"] < c["k_bits_by_layer"][min(wide)] <= 4
        by_width.setdefault(c["k_bits_by_layer"][min(wide)], []).append(wide)
    for sets in by_width.values():
        sets.sort(key=len)
        assert all(a < b for a, b in zip(sets, sets[1:]))
    if meta.get("k_bits_by_layer"):  # a mix won: its wider layers are the ones its ranking put first
        gains, wide = meta["k_layer_gains"], [i for i, b in enumerate(meta["k_bits_by_layer"]) if b > meta["k_bits"]]
        assert min(gains[i] for i in wide) >= max([gains[i] for i in range(len(gains)) if i not in wide],
                                                  default=-math.inf)


def test_mixed_candidates_fit_widen_in_order_and_keep_the_largest_windows():
    base = OscarConfig(k_bits=2, v_bits=2, cluster_dim=64, k_clip=0.7)
    order = [5, 1, 7, 0, 3, 2]  # layers 4 and 6 did not gain
    found = mixed_candidates(base, 0.85, order, 8, 3.0, 8192, 64, shortlist=20)
    assert [sum(b == 3 for b in c.config.k_bits_by_layer) for c in found] == list(range(1, 7))
    for c in found:
        widths, clips = c.config.k_bits_by_layer, c.config.k_clip_by_layer
        n = sum(b == 3 for b in widths)
        assert {i for i, b in enumerate(widths) if b == 3} == set(order[:n])
        assert all(clip == (0.85 if b == 3 else 0.7) for b, clip in zip(widths, clips))
        cost = [sum(stored_bits(k, 2, 64, *w, 64, 8192) for k in widths) / 8 for w in WINDOWS]
        fitting = [w for w, bits in zip(WINDOWS, cost) if bits <= 3.0]
        assert (c.config.sink, c.config.recent) == fitting[0] and c.bits == pytest.approx(min(cost[:1] + [
            bits for w, bits in zip(WINDOWS, cost) if w == fitting[0]]))
    spread = mixed_candidates(base, 0.85, order, 8, 3.0, 8192, 64, shortlist=3)
    assert [sum(b == 3 for b in c.config.k_bits_by_layer) for c in spread] == [1, 3, 6]  # ends and the middle
    assert mixed_candidates(base, 0.85, list(range(8)), 8, 3.0, 8192, 64, shortlist=20)[-1].config.k_bits_by_layer \
        .count(3) == 7  # all but one layer: all eight is a one-width format


def test_mixed_candidates_can_widen_by_more_than_one_bit():
    base = OscarConfig(k_bits=2, v_bits=2, cluster_dim=64, k_clip=0.7)
    found = mixed_candidates(base, 0.9, [3, 0, 2], 4, 3.5, 8192, 64, shortlist=20, wider_bits=4)
    assert [c.config.k_bits_by_layer for c in found] == [(2, 2, 2, 4), (4, 2, 2, 4), (4, 2, 4, 4)]
    for c in found:
        assert c.bits <= 3.5 and c.bits == pytest.approx(sum(
            stored_bits(k, 2, 64, c.config.sink, c.config.recent, 64, 8192) for k in c.config.k_bits_by_layer) / 4)


def test_the_retrieval_probe_repeats_spans_of_its_text_far_from_where_they_first_appear():
    ids = torch.arange(2000)  # distinct tokens: where a span came from is its values
    probe = retrieval_probe(ids)
    k = len(PROBE_DEPTHS)
    assert probe.shape[0] == len(ids) - k * PROBE_TOKENS  # haystack, the spans inserted, the spans repeated
    body, repeats = probe[:-k * PROBE_TOKENS], probe[-k * PROBE_TOKENS:]
    assert sorted(body.tolist()) == sorted(set(body.tolist()))  # nothing in the haystack twice
    first = []
    for i in range(k):
        span = repeats[i * PROBE_TOKENS:(i + 1) * PROBE_TOKENS]
        assert torch.equal(span, torch.arange(int(span[0]), int(span[0]) + PROBE_TOKENS))  # a span of the text
        at = int((body == span[0]).nonzero())
        assert torch.equal(body[at:at + PROBE_TOKENS], span)
        first.append(at)
    haystack = len(ids) - 3 * k * PROBE_TOKENS
    assert first == [round(d * haystack) + i * PROBE_TOKENS for i, d in enumerate(PROBE_DEPTHS)]  # in depth order
    assert 0 < PROBE_PREFIX < PROBE_TOKENS
    short = torch.arange(5 * k * PROBE_TOKENS - 1)
    assert retrieval_probe(short) is short  # no room for a haystack longer than the spans: plain text


def test_wider_clips_spread_up_to_no_clipping():
    from oscar_export.calibration.fit import CLIP_CANDIDATES

    above = sorted(c for c in CLIP_CANDIDATES if c > 0.65)
    got = wider_clips(0.65)
    assert len(got) == WIDER_CLIPS and got[-1] == 1.0 and got == sorted(set(got)) and set(got) <= set(above)
    assert wider_clips(0.96) == [0.98, 1.0] and wider_clips(1.0) == []


def test_a_files_per_layer_key_bits_reach_export_unless_a_flag_sets_k(tmp_path):
    meta = {"budget_bits": 3.0, "k_bits": 2, "v_bits": 2, "cluster_dim": 64, "sink": 16, "recent": 128,
            "k_clip": 0.7, "v_clip": 0.7, "k_bits_by_layer": [2, 3, 3, 2], "k_clip_by_layer": [0.7, 0.8, 0.8, 0.7]}
    config = config_for(meta, 64)
    assert config.k_bits_by_layer == (2, 3, 3, 2) and config.k_clip_by_layer == (0.7, 0.8, 0.8, 0.7)
    assert config.layer(1) == OscarConfig(k_bits=3, k_clip=0.8, v_clip=0.7, sink=16, recent=128)
    for flag in (dict(k_bits=4), dict(k_clip=0.9)):  # a K the user sets holds for every layer
        assert not config_for(meta, 64, **flag).mixed



def test_export_takes_the_format_from_the_file_unless_a_flag_says_otherwise(budget_file):
    rs = load_rotations(budget_file)
    meta = rs.metadata
    config = config_for(rs.metadata, 64)
    assert (config.k_bits, config.v_bits, config.cluster_dim, config.sink, config.recent, config.k_clip) == \
        (meta["k_bits"], meta["v_bits"], meta["cluster_dim"], meta["sink"], meta["recent"], meta["k_clip"])
    assert config_for(rs.metadata, 64, k_bits=4, sink=8).k_bits == 4 and config_for(rs.metadata, 64, sink=8).sink == 8


def test_plan_uses_the_files_format(budget_file, capsys):
    meta = load_rotations(budget_file).metadata
    assert main(["plan", "--rotations", str(budget_file), "--context", "1024", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["config"]["k_bits"] == meta["k_bits"] and plan["config"]["recent"] == meta["recent"]
    assert plan["kv_bytes"] * 8 / (1024 * 2 * 64 * 2 * 4) == pytest.approx(meta["bits_per_element"], rel=1e-6)


def test_context_needs_a_budget(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "r.safetensors"), "--context", "1024"]) == 2
    assert "expected --budget-bits with it" in capsys.readouterr().err


@pytest.mark.parametrize("budget", [2.0, 0.0])
def test_an_unreachable_budget_is_refused_before_the_rotation_fit(monkeypatch, budget):
    import oscar_export.calibration.fit as calibrate

    def no_fit(*args, **kwargs):
        raise AssertionError("the rotations were fitted for a budget that cannot be met")

    monkeypatch.setattr(calibrate, "fit_rotations", no_fit)
    model, tokenizer = load_model("bundled")  # head_dim 64: at least 2.5 bits per element in the body
    with pytest.raises(OscarInputError, match=f"--budget-bits {budget:g}"):
        run_calibration("bundled", OscarConfig(), BUNDLED_MODEL_DIR / "heldout.txt", 1024, 256, model=model,
                        tokenizer=tokenizer, choose=format_chooser(budget, 1024, 64))


def test_the_cheapest_format_is_the_fewest_bits_of_any_the_search_tries():
    for head_dim, context, scale_dtype in ((64, 8192, "float16"), (128, 32768, "float8_e4m3fn"), (64, 300, "float16")):
        cheapest = cheapest_format(context, head_dim, scale_dtype=scale_dtype)
        scale_bits = 8 if scale_dtype == "float8_e4m3fn" else 16
        by_hand = min(stored_bits(k, v, g, s, r, head_dim, context, scale_bits) for k in SUPPORTED_BITS
                      for v in SUPPORTED_BITS for g in SUPPORTED_CLUSTER_DIMS if head_dim % g == 0 for s, r in WINDOWS)
        assert cheapest.bits == pytest.approx(by_hand)
        assert candidates(cheapest.bits, context, head_dim, scale_dtype=scale_dtype)


GiB = 2**30
ANDROID_WEIGHTS = dict(weight_bits=4, weight_group=32, weight_zero_points=False)


@pytest.mark.parametrize("memory, context, expected", [
    (8 * GiB, 32768, "ceiling"),  # room to spare: the default's ceiling
    (8 * GiB, 131072, "device"),  # the device's own budget, floored to a hundredth
])
def test_the_device_budget_is_what_the_device_leaves_at_most_the_ceiling(memory, context, expected):
    shape = model_shape("llama-3-8b")
    choice = device_budget(shape, memory, context, dict(ANDROID_WEIGHTS, embedding_bits=4), "float8_e4m3fn",
                           "feedback", ceiling=3.0)
    available = cache_budget_bits(shape, memory, context, k_feedback=True, embedding_bits=4, **ANDROID_WEIGHTS)
    assert choice["available_bits"] == pytest.approx(available, abs=1e-4)
    if expected == "ceiling":
        assert available > 3.0 and choice["budget_bits"] == 3.0
    else:
        assert available < 3.0 and choice["budget_bits"] == math.floor(available * 100) / 100
    formats = candidates(choice["budget_bits"], context, shape.head_dim, k_rounding="feedback",
                         scale_dtype="float8_e4m3fn")
    for c in formats:  # every format the search may pick fits the device by the planner's count
        p = plan(shape, c.config, memory, context, embedding_bits=4, **ANDROID_WEIGHTS)
        assert p["fits"], c.summary()


def test_a_device_no_format_fits_is_named_with_its_context():
    shape = model_shape("llama-3-8b")
    with pytest.raises(OscarInputError, match=r"--device-memory 8GB at --context 131072: llama-3-8b's weights and "
                                              r"the reserve leave the cache [0-9.]+ bits per K/V element: expected "
                                              r"at least [0-9.]+, the cheapest format"):
        device_budget(shape, 8 * GiB, 131072, ANDROID_WEIGHTS, "float16", "feedback")


def test_plan_shows_the_budget_the_target_searches_within(capsys):
    assert main(["plan", "--target", "android", "--model", "llama-3-8b", "--context", "131072", "--json"]) == 0
    assert "--device-memory 8GB at --context 131072" in json.loads(capsys.readouterr().out)["format_choice"]["error"]
    assert main(["plan", "--target", "android", "--model", "llama-3-8b", "--context", "131072"]) == 0
    assert "no format fits" in capsys.readouterr().out
    assert main(["plan", "--target", "android", "--model", "llama-3-8b", "--context", "65536", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    choice = p["format_choice"]
    assert choice["target"] == "android" and choice["scale_dtype"] == "float8_e4m3fn"
    assert choice["budget_bits"] == math.floor(min(choice["available_bits"], 3.0) * 100) / 100
    assert main(["plan", "--target", "ios", "--model", "llama-3-8b", "--context", "8192", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format_choice"]["scale_dtype"] == "float8_e4m3fn"
    # A format flag is an explicit format: nothing is chosen.
    assert main(["plan", "--target", "ios", "--model", "llama-3-8b", "--bits", "2", "--json"]) == 0
    assert "format_choice" not in json.loads(capsys.readouterr().out)
    assert main(["plan", "--target", "ios", "--weight-bits", "8"]) == 2
    assert "--weight-bits with --target ios: expected one of them" in capsys.readouterr().err


def test_an_export_without_format_flags_chooses_the_format_for_the_device(tmp_path, monkeypatch, capsys):
    """The default device's budget is the ceiling and its calibration ships with the bundled model; a tighter
    device gets its own budget, calibrated once and then reused; a device nothing fits is refused before export."""
    monkeypatch.setenv("OSCAR_EXPORT_CACHE", str(tmp_path / "cache"))
    shape = model_shape("bundled")
    assert main(["--target", "laptop", "--float-weights", "--out", str(tmp_path / "a"), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    choice, meta = manifest["format_choice"], manifest["rotations_metadata"]
    assert choice["budget_bits"] == 3.0 and choice["context"] == 2048 and choice["scale_dtype"] == "float8_e4m3fn"
    assert meta["budget_bits"] == 3.0 and meta["budget_context"] == 2048
    assert manifest["config"]["scale_dtype"] == "float8_e4m3fn" and manifest["config"]["sink"] >= 1
    assert manifest["plan"]["fits"] and manifest["plan"]["bits_per_element"] == choice["bits_per_element"] <= 3.0
    assert not (tmp_path / "cache").exists()  # the shipped calibration, not a new one

    context, target_bits = 2048, 2.8  # a device that leaves about 2.8 bits per element at 2048 tokens
    weights = {"weight_bits": 16}  # laptop --float-weights
    elements = context * shape.layers * shape.kv_heads * shape.head_dim * 2
    fixed = cache_budget_bits(shape, 2**30, context, reserve=0, k_feedback=True, **weights)
    weight_bytes = 2**30 - fixed * elements / 8
    memory = int((target_bits * elements / 8 + weight_bytes) / 0.8) + 1
    flags = ["--target", "laptop", "--float-weights", "--context", str(context), "--device-memory", str(memory),
             "--calibration-tokens", "2048"]
    assert main([*flags, "--out", str(tmp_path / "b")]) == 0
    line = capsys.readouterr().out
    assert "rotations calibrated for the device;" in line
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    choice = manifest["format_choice"]
    available = cache_budget_bits(shape, memory, context, k_feedback=True, **weights)
    assert 2.75 < available < 2.85 and choice["budget_bits"] == math.floor(available * 100) / 100
    assert manifest["plan"]["fits"] and manifest["plan"]["bits_per_element"] <= choice["budget_bits"]
    assert main([*flags, "--out", str(tmp_path / "c")]) == 0
    assert "calibrated for the device (reused)" in capsys.readouterr().out

    assert main([*flags[:-4], "--device-memory", str(int(weight_bytes / 0.8) + 1), "--out", str(tmp_path / "d")]) == 2
    assert "leave the cache 0.000 bits per K/V element: expected at least" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
