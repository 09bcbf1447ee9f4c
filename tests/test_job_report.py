"""What bt-train shows while and after it runs: one time left for the whole job that weighs its
steps by their cost and says how sure it is, and a report that names the corpus it scored and
numbers blocks as bt-peer's --block does."""

import io

from blocktrain.blocks.config import JobConfig
from blocktrain.blocks.job import blocktrain_phase, job_work, summary
from blocktrain.blocks.progress import Eta, LineProgress
from blocktrain.blocks.schedule import make_plans, work_segments


def test_work_segments_weigh_each_wall_step_by_the_blocks_training_at_it():
    relay = make_plans("relay", 3, 10, 0.3)
    assert work_segments(relay, 10, [1.0, 2.0, 3.0]) == [(10, 1.0), (10, 2.0), (10, 3.0)]
    assert work_segments(make_plans("parallel", 3, 10, 0.3), 10, [1.0, 2.0, 3.0]) == [(10, 6.0)]
    phase = blocktrain_phase(relay, 10)  # block numbers from 0, as bt-peer's --block
    assert [phase(t) for t in (1, 10, 11, 30, 31)] == [
        "block 0, step 1/10", "block 0, step 10/10", "block 1, step 1/10", "block 2, step 10/10",
        "block 2's draft model"]


def test_one_bar_counts_the_whole_job_blocks_draft_and_reference():
    job = JobConfig()
    plans = make_plans(job.schedule, 3, job.train.steps, job.train.decay_frac)
    work = job_work(job, plans)
    S, D = job.train.steps, job.train.draft_steps
    assert [n for n, _ in work] == [S, S, S, D, S, D]  # 3 blocks, the draft phase, the reference, its draft
    assert work[4][1] > max(c for _, c in work[:3])  # a step of the whole model costs more than a block's
    no_ref = job_work(JobConfig(reference=False), plans)
    assert sum(n for n, _ in no_ref) == 3 * S + D


def _eta(rates, window_s=10.0, cpu_share=1.0, threads=1, total_steps=10_000):
    """An Eta fed one reading a second: ``rates`` steps/s for each window in turn."""
    e = Eta([(total_steps, 1.0)], now=0.0, threads=threads, window_s=window_s)
    t, n = 0.0, 0.0
    for r in rates:
        for _ in range(int(window_s)):
            t, n = t + 1, n + r
            e.observe(n, t, cpu=t * cpu_share)
    return e


def test_the_time_left_is_one_figure_when_the_rate_holds_and_a_range_that_says_why_when_not():
    steady = _eta([10] * 5)
    assert steady.text() == f"about {round((10_000 - 500) / 10 / 60)} min left"
    swung = _eta([40, 10, 40, 10, 10])  # a busy machine: the rate swings 4x
    eta, lo, hi, why = swung.estimate()
    assert lo < eta <= hi and hi / lo > 3.5 and "rate changed 4.0x" in why
    assert " to " in swung.text() and "rate changed" in swung.text()
    starved = _eta([10] * 5, cpu_share=0.3, threads=2)  # 30% of a core for a job of 2 threads
    assert "the machine is busy: this process got 30% of a core, asks for 2" in starved.text()
    assert Eta([(10, 1.0)], now=0.0).text() == "time left: after the first steps"


def test_the_time_left_weighs_the_steps_left_by_their_cost():
    e = Eta([(100, 1.0), (100, 3.0)], now=0.0, window_s=10.0)  # the second half costs 3x a step
    for t in range(1, 51):
        e.observe(t, float(t))  # one cheap step a second: 1 unit/s
    assert round(e.estimate()[0]) == 50 + 300  # not 150 s, as counting steps would say


def test_the_log_line_gives_the_weighted_time_left_and_the_phase():
    out = io.StringIO()
    with LineProgress("bt-train", 20, every_s=1e9, stream=out, threads=0, work=[(10, 1.0), (10, 2.0)]) as p:
        p.set_postfix_str("block 0, step 3/10, valid CE 2.5")
        p.eta.t0 -= 3.0
        p.eta.samples[0] = (p.eta.t0, 0.0, 0.0)
        p.update(3)
        line = p.line()
    assert line.startswith("bt-train: 3/20 steps in") and "left" in line and line.endswith("valid CE 2.5")
    assert out.getvalue().startswith("bt-train: done, 3/20 steps")


def _result(data):
    job = JobConfig(data=data)
    return {"job": {"data": job.data or "embedded WikiText-2", "corpus": None, "train": {"steps": 300}},
            "blocktrain": {"test_ce_heads": [2.3, 2.1, 2.0]}, "wall_seconds": 1.0, "peak_rss_mib": 1.0}


def test_the_report_names_the_corpus_it_scored_and_numbers_blocks_from_0(tmp_path):
    notes = tmp_path / "my-notes.txt"
    notes.write_text("text")
    text = summary(_result(str(notes)))
    assert "WikiText" not in text and f"the test split of {notes}" in text
    assert "head of block 0 " in text and "head of block 2 " in text and "block 3" not in text
    assert "(WikiText-2 wiki.test.tokens, embedded)" in summary(_result(None))


def test_a_byte_count_reads_in_mib_not_as_an_unrounded_rate():
    """`bt-data prepare` printed '312802441.18 byte/s'."""
    out = io.StringIO()
    with LineProgress("bt-data prepare", 3 * 2**30, unit="byte", every_s=1e9, stream=out) as p:
        p.t0 -= 2.0
        p.update(600 * 2**20)
    line = out.getvalue().strip()
    assert line.startswith("bt-data prepare: done, 600.0 MiB of 3,072.0 MiB in 2 s (300.0 MiB/s")
    assert "byte/s" not in line
