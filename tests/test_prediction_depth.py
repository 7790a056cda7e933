"""How far ahead experts are predicted, and what it costs (bench/replay.py's
prediction measures, scripts/predict_depth.py): recall, precision and waste
counted as defined, a learned table that finds a fixed mapping, the slot
replay's read-ahead counts, the decode timeline's arithmetic on cases worked
by hand, and the script's router rankings on a converted model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from moestream.bench.replay import (
    cooccurrence,
    decode_timeline,
    policy_step_hits,
    prediction_quality,
    prefetch_replay,
    protected_step_hits,
    ranked,
    table_scores,
)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "predict_depth.py"


def test_prediction_quality_counts_recall_precision_and_waste() -> None:
    routed = np.array([[0, 1], [2, 3]])
    predicted = np.array([[1, 5, 6], [2, 3, 4]])  # 1 of 2, then 2 of 2 routed
    q = prediction_quality(routed, predicted)
    assert q == {"recall": 3 / 4, "precision": 3 / 6, "wasted": 3 / 2}
    with pytest.raises(ValueError, match="1 rows of predictions for 2 routed"):
        prediction_quality(routed, predicted[:1])


def test_ranked_orders_best_first_lower_id_on_ties() -> None:
    scores = np.array([[0.1, 0.9, 0.5, 0.9]])
    assert ranked(scores, 3).tolist() == [[1, 3, 2]]


def test_a_learned_table_finds_a_fixed_mapping() -> None:
    """Layer B routes to (e + 3) mod 8 for each e layer A routes to: the table
    learned on some tokens predicts B from A on others with recall 1."""
    rng = np.random.default_rng(0)
    src = np.stack([rng.choice(8, 2, replace=False) for _ in range(200)])
    dst = (src + 3) % 8
    table = cooccurrence(src[:100], dst[:100], 8)
    assert np.allclose(table.sum(1), 2)  # each row: the k experts of B it implies
    top = ranked(table_scores(table, src[100:]), 2)
    assert prediction_quality(dst[100:], top)["recall"] == 1.0


def test_prefetch_replay_counts_reads_ahead_of_misses() -> None:
    routed = np.array([[0, 1], [2, 3], [0, 1], [4, 5]])
    # 2 slots: every call misses both experts (8 misses)
    perfect = prefetch_replay(routed, [routed], 2, 8, "lru")
    assert perfect == {"misses": 8, "hinted": 8, "used": 8, "early_0": 8}
    wrong = prefetch_replay(routed, [(routed + 6) % 8], 2, 8, "lru")
    assert wrong["misses"] == 8 and wrong["used"] == 0 and wrong["hinted"] > 0
    # the earlier source reads 0 and 2 ahead; the later one adds the rest
    early = np.array([[0, 7], [2, 7], [6, 7], [6, 7]])
    both = prefetch_replay(routed, [early, routed], 2, 8, "lru")
    assert both["early_0"] == 2 and both["early_1"] == 6 and both["used"] == 8


def test_decode_timeline_without_prediction_waits_for_every_read() -> None:
    """No read ahead: a token takes each layer's compute plus each miss's read."""
    routed = np.array([[[0, 1], [2, 3], [0, 1]], [[4, 5], [4, 5], [6, 7]]])
    got = decode_timeline(routed, {}, 2, 8, read=0.25, compute=1.0, policy="lru")
    misses = 2 + 2 + 2 + 2 + 0 + 2  # layer 0: 2, 2, 2; layer 1: 2, 0, 2
    assert got["time_per_token"] == pytest.approx((6 * 1.0 + misses * 0.25) / 3)
    assert got["reads_per_token"] == misses / 3


def test_decode_timeline_hides_reads_predicted_a_layer_ahead() -> None:
    """Layer 1's experts predicted at layer 0, and read during its compute:
    only layer 0's misses are waited for. A late read ahead is dropped."""
    routed = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    hints = {1: {1: routed[1]}}
    got = decode_timeline(routed, hints, 2, 8, read=0.25, compute=1.0)
    assert got["time_per_token"] == pytest.approx(2 + 2 * 0.25)
    assert got["reads_per_token"] == 4
    slow = decode_timeline(routed, hints, 2, 8, read=2.0, compute=1.0)
    # layer 0 reads 2 records (4 s) and computes (5 s); layer 1's first read
    # ahead began at 4 and ends at 6; its second had not begun by layer 1's
    # call (5 s), so it is dropped and read as a miss (6-8 s); compute: 9 s
    assert slow["time_per_token"] == pytest.approx(9.0)
    assert slow["reads_per_token"] == 4


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("predict_depth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_ranks_each_router_on_the_recorded_inputs(
    script, converted, tmp_path
) -> None:
    """Depth 0, a layer's own router on its input, ranks first what that
    layer routed: the inputs recorded are the MoE blocks' own."""
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    routed, ahead, record = script.record(str(converted), str(text), 40, (0, 1))
    layers, tokens, k = routed.shape
    assert tokens == 40 and record > 0
    own = np.sort(ahead[0][..., :k], -1)
    assert np.array_equal(own, np.sort(routed, -1))
    assert ahead[1].shape == (layers - 1, tokens, 8)  # every expert, ranked


def test_a_protected_expert_is_not_the_victim_while_another_can_go() -> None:
    trace = np.array([[0], [1], [2], [0]])
    plain = policy_step_hits(trace, 2, "lru", 4)
    spare0 = np.array([[3], [3], [0], [3]])  # at row 2, 0 (the LRU) is spared
    assert plain.tolist() == [0, 0, 0, 0]
    assert protected_step_hits(trace, spare0, 2, "lru", 4).tolist() == [0, 0, 0, 1]
    # every resident expert protected: the policy's victim still goes
    both = np.array([[3, 3], [3, 3], [0, 1], [3, 3]])
    assert protected_step_hits(trace, both, 2, "lru", 4).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="3 rows to protect for 4 tokens"):
        protected_step_hits(trace, spare0[:3], 2, "lru", 4)
