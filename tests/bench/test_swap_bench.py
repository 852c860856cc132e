"""`python -m benchmarks --swap` on CPU: pairs, the filler's arithmetic, the over-commit evidence,
the figures and targets from recorded rounds, the Markdown and the timeline PNG, and one
smoke run through real stage processes (portable backend, simulated device). The GPU
figures come from the device run (benchmarks/results/swap_gpu.md)."""

from __future__ import annotations

import json

import pytest

from benchmarks import swap, swap_report
from benchmarks.__main__ import main as cli_main
from benchmarks.memory import WORKLOADS

GiB = 1 << 30


def reply(
    op: str,
    start: float,
    end: float,
    copied: int,
    *,
    resident: int | None = None,
    mapped=(),
    exact: bool = True,
    gate=None,
    free: int | None = None,
    copies=None,
) -> dict:
    r = {
        "op": op,
        "start_s": start,
        "end_s": end,
        "copied_bytes": copied,
        "resident_before": resident,
        "free_before": free,
        "gate": gate,
        "timeline": {
            "copies": copies if copies is not None else [[start, end, copied, 0]],
            "mapped": [list(m) for m in mapped],
            "per_copy": copies is not None,
        },
    }
    if op == "wake":
        r["exact"] = exact
    return r


def swap_round(
    t: float,
    a_s: float,
    b_s: float,
    nbytes: int = 16 * GiB,
    *,
    exact=True,
    used=70 * GiB,
    total=80 * GiB,
    refusals=0,
    a_mapped=(),
    b_mapped=(),
    b_free=40 * GiB,
) -> dict:
    return {
        "kind": "swap",
        "a": reply("sleep", t, t + a_s, nbytes, resident=20 * GiB, mapped=a_mapped),
        "b": reply(
            "wake",
            t,
            t + b_s,
            nbytes,
            resident=0,
            mapped=b_mapped,
            exact=exact,
            free=b_free,
            gate={"driver_refusals": refusals, "waited_s": 0.05, "queries": 3},
        ),
        "reset": [reply("sleep", t + 1, t + 1.2, nbytes), reply("wake", t + 1.3, t + 1.6, nbytes)],
        "samples": {"count": 300, "max_used": used, "total": total, "series": [[t, used]]},
    }


def seq_round(t: float, a_s: float, b_s: float, kind: str = "seq", nbytes: int = 16 * GiB) -> dict:
    return {
        "kind": kind,
        "a": reply("sleep", t, t + a_s, nbytes),
        "b": reply("wake", t + a_s + 0.01, t + a_s + 0.01 + b_s, nbytes),
        "reset": [reply("sleep", t + 1, t + 1.2, nbytes), reply("wake", t + 1.3, t + 1.6, nbytes)],
    }


def case(pair: str, method: str, rounds: list[dict], **extra) -> dict:
    return {"pair": pair, "method": method, "rounds": rounds, "notes": [], **extra}


def dataset(results: list[dict], pairs=("16g:16g",)) -> dict:
    return {
        "command": "python -m benchmarks --swap",
        "device": "cuda",
        "machine": {"gpu": "NVIDIA H100 80GB HBM3, 81559 MiB"},
        "reps": 4,
        "pairs": list(pairs),
        "methods": [],
        "results": results,
        "wall_s": 200.0,
    }


# ---------------------------------------------------------------------- configuration


def test_pairs_parse_and_refuse_what_they_do_not_know():
    assert swap_report.parse_pair("8g:16g+fill") == ("8g", "16g", True)
    assert swap_report.parse_pair("16g") == ("16g", "16g", False)
    with pytest.raises(ValueError, match=r"only option is '\+fill'"):
        swap_report.parse_pair("8g:16g+full")
    with pytest.raises(ValueError, match="is not A:B"):
        swap_report.parse_pair("8g:")


def test_the_filler_leaves_too_little_for_b_until_a_has_released_and_enough_after():
    for a, b in (("8g", "16g"), ("16g", "16g"), ("16g", "8g"), ("2m", "4m")):
        device = "cpu" if a.endswith("m") else "cuda"
        leave = swap.fill_leave_bytes(a, b, device)
        a_bytes, b_bytes = swap.stage_bytes(a), swap.stage_bytes(b)
        assert leave < b_bytes  # B cannot wake on what is free before A releases
        reserve = 32 << 20 if device == "cuda" else 0
        assert leave + a_bytes >= b_bytes + reserve  # and fits once A has released all it holds
    assert swap.stage_bytes("16g") == 20 * GiB


def test_the_engine_case_lays_the_synthetic_runner_out_like_the_workload():
    args = swap.synthetic_args("16g", 7, "cuda")
    assert isinstance(args, dict) and args["hidden"] == 4096 and args["tensor_count"] == 512
    rows = args["weights_bytes"] // (args["tensor_count"] * args["hidden"] * 2)
    assert rows * args["hidden"] * 2 == WORKLOADS["16g"].weights[0]  # each matrix is one 32 MiB tensor
    assert args["kv_bytes"] == 4 * GiB and "cpu_threads" not in args
    assert swap.synthetic_args("2m", 7, "cpu")["cpu_threads"] == 1
    assert "mixes 4 tensor sizes" in swap.synthetic_args("mixed", 7, "cuda")


def test_methods_that_cannot_run_say_why():
    assert "GPU figure" in swap.skip_reason("limit", "cpu")
    assert "host arena" in swap.skip_reason("omni-swap-clean", "cpu")
    assert swap.skip_reason("omni-swap-dirty", "cpu") is None
    assert swap.skip_reason("engine-swap", "cpu") is None


def test_unknown_methods_and_big_workloads_on_cpu_are_refused(tmp_path, capsys):
    base = ["--swap", "--device", "cpu", "--out", str(tmp_path / "x")]
    assert cli_main([*base, "--methods", "omni-swap,limit"]) == 2
    assert "unknown swap method(s) ['omni-swap']" in capsys.readouterr().err
    assert cli_main([*base, "--workloads", "16g:16g"]) == 2
    assert "smoke workloads" in capsys.readouterr().err
    assert cli_main([*base, "--workloads", "2m:64g"]) == 2
    assert "unknown workload '64g'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------- over-commit evidence


def test_allocator_growth_counts_a_map_from_its_start_and_an_unmap_from_its_end():
    a = reply("sleep", 0.0, 1.0, 0, resident=10, mapped=[(0.5, 4)])  # A releases 6 at t=0.5
    fits = reply("wake", 0.0, 1.0, 0, resident=0, mapped=[(0.2, 3), (0.6, 9)])
    assert swap_report.allocator_peak_growth(a, fits) == 3  # 3 before A released; 9 - 6 after
    early = reply("wake", 0.0, 1.0, 0, resident=0, mapped=[(0.2, 3), (0.4, 9)])  # 9 mapped before A's unmap
    assert swap_report.allocator_peak_growth(a, early) == 9
    same_instant = reply("wake", 0.0, 1.0, 0, resident=0, mapped=[(0.5, 9)])
    assert swap_report.allocator_peak_growth(a, same_instant) == 3
    assert swap_report.allocator_peak_growth(reply("sleep", 0, 1, 0), fits) is None  # no figure of A's


@pytest.mark.parametrize(
    ("change", "ok"), [({}, True), ({"refusals": 1}, False), ({"used": 81 * GiB}, False), ({"b_free": 5}, False)]
)
def test_each_piece_of_over_commit_evidence_can_fail_the_round(change, ok):
    mapped = {"a_mapped": [(0.5, 0)], "b_mapped": [(0.4, 20 * GiB)]}  # B maps it all before A lets go
    result = swap_report.overcommit(swap_round(0.0, 0.4, 0.5, **mapped, **change))
    assert result["ok"] is ok and result["checks"] == 3
    assert swap_report.overcommit({"a": {}, "b": {}})["ok"] is False  # no evidence is no proof


# ---------------------------------------------------------------------- figures and targets


def _equal_pair_results(dirty_s=0.40, clean_s=0.33, seq=(0.30, 0.35)):
    first = 0.9
    return [
        case(
            "16g:16g",
            "limit",
            [swap_round(i, 0.32, 0.32) for i in range(4)] + [seq_round(10 + i, 0.31, 0.31, "alone") for i in range(2)],
        ),
        case("16g:16g", "omni-seq", [seq_round(i, *seq) for i in range(4)]),
        case(
            "16g:16g",
            "omni-swap-dirty",
            [swap_round(0, first, first)]
            + [swap_round(i, dirty_s, dirty_s) for i in range(1, 4)]
            + [seq_round(10 + i, 0.30, 0.35, "alone") for i in range(2)],
        ),
        case(
            "16g:16g",
            "omni-swap-clean",
            [swap_round(i, 0.01, clean_s) for i in range(4)]
            + [seq_round(10 + i, 0.01, 0.32, "alone") for i in range(2)],
        ),
        case("16g:16g", "vllm-seq", [], skipped="vllm is not importable"),
    ]


def test_summary_reports_the_first_swap_apart_and_ratios_against_alone():
    results = _equal_pair_results()
    s = swap_report.summarize(results[2])
    assert s["first_s"] == pytest.approx(0.9) and s["later_s"] == pytest.approx(0.40) and s["reps"] == 4
    assert s["a_alone_s"] == pytest.approx(0.30) and s["b_alone_s"] == pytest.approx(0.35)
    assert s["vs_alone"] == pytest.approx(0.40 / 0.35)
    assert s["later_GBps"] == pytest.approx(2 * 16 * GiB / 0.40 / 1e9)
    assert s["bit_exact"] and s["wakes_checked"] == 4 * 2 + 2 * 2  # B's wake and A's (reset) per round
    seq = swap_report.summarize(results[1])
    assert seq["later_s"] == pytest.approx(0.65) and seq["a_alone_s"] == pytest.approx(0.30)
    limit = swap_report.summarize(results[0])
    assert limit["d2h_alone_GBps"] == pytest.approx(16 * GiB / 0.31 / 1e9)
    assert limit["duplex_total_GBps"] == pytest.approx(2 * 16 * GiB / 0.32 / 1e9)
    assert swap_report.summarize(results[4]) == {}


def test_one_inexact_wake_anywhere_marks_the_case():
    rounds = [swap_round(i, 0.4, 0.4) for i in range(3)]
    rounds[2]["reset"][1]["exact"] = False  # A's wake in the last reset
    assert not swap_report.summarize(case("16g:16g", "omni-swap-dirty", rounds))["bit_exact"]


def test_targets_met_and_missed_say_by_how_much():
    met = swap_report.targets(dataset(_equal_pair_results()))
    by = {(t["method"], t["target"]): t for t in met}
    dirty_alone = by[("omni-swap-dirty", "swap <= 1.15 x max(A sleep, B wake) alone")]
    assert dirty_alone["met"] and dirty_alone["value"] == pytest.approx(0.40 / 0.35)
    assert by[("omni-swap-dirty", "swap >= 1.7 x faster than omni-seq")]["value"] == pytest.approx(0.65 / 0.40)
    assert not by[("omni-swap-dirty", "swap >= 1.7 x faster than omni-seq")]["met"]
    assert by[("omni-swap-clean", "swap <= 1.1 x B's wake alone")]["met"]
    missed = swap_report.targets(dataset(_equal_pair_results(dirty_s=0.46, clean_s=0.40)))
    by = {(t["method"], t["target"]): t for t in missed}
    assert by[("omni-swap-dirty", "swap <= 1.15 x max(A sleep, B wake) alone")]["by"] == "0.164 (14%)"
    assert not by[("omni-swap-clean", "swap <= 1.1 x B's wake alone")]["met"]
    # timing targets bind two equal stages without a filler; a filled pair gets the over-commit target
    filled = [dict(c, pair="8g:16g+fill") for c in _equal_pair_results()]
    rows = swap_report.targets(dataset(filled, pairs=("8g:16g+fill",)))
    assert not any(" x " in t["target"] for t in rows)
    assert {t["method"] for t in rows if t["target"] == "zero over-commit"} == {"omni-swap-dirty", "omni-swap-clean"}


def test_rates_spread_each_copy_over_its_interval_and_keep_every_byte():
    copies = [[0.0, 0.010, 1e9, 0], [0.005, 0.015, 2e9, 1], [0.02, 0.02, 5e8, 0]]
    rates = swap_report.rate_series(copies, 0.0, 0.001, 30)
    assert sum(r * 0.001 * 1e9 for r in rates) == pytest.approx(3.5e9)
    assert rates[2] == pytest.approx(100.0) and rates[7] == pytest.approx(300.0)  # 1 GB/10 ms, + 2 GB/10 ms


def test_markdown_and_png_from_recorded_rounds(tmp_path):
    pytest.importorskip("matplotlib")
    data = dataset(_equal_pair_results())
    md = swap_report.render_markdown(data)
    assert "## A = 16g, B = 16g" in md and "skipped: vllm is not importable" in md
    assert "| omni-core swap, dirty weights | 0.900 | 0.400 [0.400-0.400] |" in md
    assert "missed by 0.075 (4%)" in md  # 1.625 x against the 1.7 x target
    assert "duplex 53.7 + 53.7 = 107.4 GB/s" in md
    assert swap_report.render_png(data, tmp_path / "t.png") is None
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert "no swap round" in swap_report.render_png(dataset([_equal_pair_results()[1]]), tmp_path / "n.png")


# ---------------------------------------------------------------------- a run through real processes


def test_cpu_smoke_swap_waits_for_the_outgoing_stage_and_never_over_commits(tmp_path):
    """Two portable stages and a filler on a simulated device: B's wake must wait for A's memory."""
    out = tmp_path / "out"
    rc = cli_main(
        [
            "--swap",
            "--device",
            "cpu",
            "--workloads",
            "2m:4m+fill",
            "--methods",
            "omni-swap-dirty",
            "--reps",
            "2",
            "--out",
            str(out),
        ]
    )
    data = json.loads((out / "swap_cpu.json").read_text())
    assert rc == 0, data
    (result,) = data["results"]
    assert result["fill"]["free_after"] < swap.stage_bytes("4m")  # the filler binds
    swaps = [r for r in result["rounds"] if r["kind"] == "swap"]
    assert len(swaps) == 2 and len([r for r in result["rounds"] if r["kind"] == "alone"]) == swap.ALONE_ROUNDS
    for rnd in swaps:
        a_released_s = rnd["a"]["timeline"]["mapped"][-1][0]
        if rnd["b"]["gate"]["first_query_s"] < a_released_s:  # B asked while A still held memory:
            assert rnd["b"]["gate"]["queries"] >= 2  # the filler binds, so it had to ask again
        evidence = swap_report.overcommit(rnd)
        assert evidence["ok"] and evidence["checks"] == 3 and evidence["samples"] > 0
        assert 0 < evidence["growth"] <= evidence["free_before"]
        assert rnd["b"]["end_s"] > a_released_s  # B finished after A released
    s = swap_report.summarize(result)
    assert s["bit_exact"] and s["wakes_checked"] == 2 * 2 + 2 * 2
    assert "zero over-commit | none | yes" in (out / "swap_cpu.md").read_text()
    assert (out / "swap_timeline_cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_cpu_smoke_late_release_is_chosen_only_where_b_fits_beside_a(tmp_path):
    """`omni-swap-late` tells A what B wakes: with room for both (4m:4m) A releases after its
    last copy in every swap; where the filler makes B wait for A's memory, in none."""
    out = tmp_path / "out"
    args = ["--swap", "--device", "cpu", "--workloads", "4m:4m,2m:4m+fill", "--methods", "omni-swap-late"]
    rc = cli_main([*args, "--reps", "2", "--out", str(out)])
    data = json.loads((out / "swap_cpu.json").read_text())
    assert rc == 0, data
    late = {
        r["pair"]: [rnd["a"]["release_late"] for rnd in r["rounds"] if rnd["kind"] == "swap"] for r in data["results"]
    }
    assert late == {"4m:4m": [True, True], "2m:4m+fill": [False, False]}
    for result in data["results"]:
        assert swap_report.summarize(result)["bit_exact"]
        for rnd in (r for r in result["rounds"] if r["kind"] == "swap"):
            assert swap_report.overcommit(rnd)["ok"]
    assert "A released after its last copy in 2 of 2 swaps" in (out / "swap_cpu.md").read_text()
