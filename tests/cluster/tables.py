"""Reading the final table `diloco local` prints (stderr, not a terminal) and holding it
to the run's summary.json: the two are drawn from the same records."""


def assert_final_table_agrees(stderr: str, summary: dict) -> None:
    lines = stderr.splitlines()
    titles = [i for i, line in enumerate(lines) if line.startswith("diloco local — ") and " after " in line]
    assert titles, stderr[-3000:]
    table = lines[titles[-1]:]
    state = "interrupted" if summary["interrupted"] else "finished"
    assert table[0].startswith(f"diloco local — {state} after "), table[0]
    rows = {cells[0]: cells for line in table if line.startswith("│")
            for cells in [[c.strip() for c in line.strip("│").split("│")]]}
    assert sorted(rows) == sorted(l["id"] for l in summary["learners"]), (rows, summary["learners"])
    for learner in summary["learners"]:
        row = rows[learner["id"]]
        assert row[1:4] == [learner["state"], learner["pool"], f"{learner['tokens']:,}"], (row, learner)
        assert row[5] == f"{learner['inner_steps']:,}", (row, learner)
    caption = " ".join(line.strip() for line in table if not line.startswith(("│", "┏", "┃", "┡", "└", "diloco")))
    assert f"global tokens {summary['tokens']:,}" in caption and f"rounds {summary['rounds']} " in caption, caption
