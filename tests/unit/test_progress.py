"""The status page's history (diloco.coordinator.core.progress) stays bounded whatever learners
send, and the run's token total (Membership.tokens_total) outlives pruned learners."""

from diloco.coordinator.core.progress import MAX_CURVES, MAX_EVENTS, MAX_POINTS, LossCurves, RecentEvents


def test_a_curve_is_thinned_not_cut():
    curves = LossCurves()
    for i in range(MAX_POINTS + 1):
        curves.add("L0", float(i), 10 * i, 1.0 / (i + 1))
    points = [[p.tokens, p.loss] for p in curves.curves["L0"]]  # what is kept
    # Every other point went; the first and the newest stay: the curve still spans the run.
    assert len(points) == MAX_POINTS // 2 + 1
    assert points[0] == [0, 1.0] and points[-1] == [10 * MAX_POINTS, 1.0 / (MAX_POINTS + 1)]
    assert [p[0] for p in points[:3]] == [0, 20, 40]


def test_only_a_new_window_adds_a_point():
    curves = LossCurves()
    curves.add("L0", 1.0, 100, 2.0)
    curves.add("L0", 2.0, 300, 2.0)  # the same window's mean, the run's tokens moved on: no step drawn
    curves.add("L0", 3.0, 400, 1.5)
    assert curves.to_json() == {"L0": [[100, 2.0], [400, 1.5]]}


def test_the_curve_extended_longest_ago_makes_room():
    curves = LossCurves()
    for i in range(MAX_CURVES):
        curves.add(f"L{i}", float(i), i, 1.0)
    curves.add("L0", 1000.0, 5000, 0.5)  # L0 reported last; L1 longest ago
    curves.add("Lnew", 1001.0, 6000, 0.9)
    kept = curves.curves
    assert len(kept) == MAX_CURVES and "L1" not in kept and "L0" in kept
    assert [(p.tokens, p.loss) for p in kept["Lnew"]] == [(6000, 0.9)]


def test_recent_events_newest_first_and_bounded():
    events = RecentEvents()
    for i in range(MAX_EVENTS + 5):
        events.add(float(i), "joined", f"L{i} joined")
    listed = events.to_json()
    assert len(listed) == MAX_EVENTS
    assert listed[0] == {"t": float(MAX_EVENTS + 4), "kind": "joined", "text": f"L{MAX_EVENTS + 4} joined"}
    assert listed[-1]["text"] == "L5 joined"


def test_the_page_is_sent_the_recent_curves_thinned():
    from diloco.coordinator.core.progress import SHOWN_CURVES, SHOWN_POINTS

    curves = LossCurves()
    for i in range(SHOWN_CURVES + 3):
        for j in range(MAX_POINTS):
            curves.add(f"L{i}", float(i * 10_000 + j), j, 10.0 - j / MAX_POINTS)
    sent = curves.to_json()
    # The most recently extended learners; the three that reported first are left out.
    assert set(sent) == {f"L{i}" for i in range(3, SHOWN_CURVES + 3)}
    for points in sent.values():
        assert len(points) == SHOWN_POINTS
        assert points[0] == [0, 10.0] and points[-1] == [MAX_POINTS - 1, 10.0 - (MAX_POINTS - 1) / MAX_POINTS]
        assert [p[0] for p in points] == sorted({p[0] for p in points})  # evenly spread, none twice
