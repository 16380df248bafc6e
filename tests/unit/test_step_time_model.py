"""The step-time model: least squares over measured steps, and what the scheduler reads from it."""

from dataclasses import astuple

import pytest

from goodserve.engine.core.step_time_model import MIN_STEPS, StepTimeFit, StepTimeModel


def test_fit_recovers_the_line_the_steps_lie_on():
    model = StepTimeModel(refit_every=1)
    shapes = [(1, 0), (8, 0), (8, 512), (32, 256), (4, 1024), (16, 0), (2, 2048), (64, 128)]
    for rows, tokens in shapes:
        model.observe(rows, tokens, 0, 0.005 + 0.0001 * rows + 0.00002 * tokens)
    assert astuple(model.fit) == pytest.approx((0.005, 0.0001, 0.00002, 0.0))


def test_fit_by_hand_on_noisy_steps():
    """Four steps, solved by hand: the normal equations of t = a + b rows + c tokens on
    (0,0,1.0) (1,0,2.0) (0,1,3.0) (1,1,5.0) give a = 0.75, b = 1.5, c = 2.5 (residuals +-0.25)."""
    model = StepTimeModel(refit_every=1)
    for rows, tokens, t in [(0, 0, 1.0), (1, 0, 2.0), (0, 1, 3.0), (1, 1, 5.0)] * 2:
        model.observe(rows, tokens, 0, t)
    assert (model.fit.a, model.fit.b, model.fit.c) == pytest.approx((0.75, 1.5, 2.5))


def test_no_fit_from_too_few_steps_or_one_shape():
    model = StepTimeModel(refit_every=1)
    for _ in range(MIN_STEPS - 1):
        model.observe(8, 0, 0, 0.01)
    assert model.fit is None
    model.observe(8, 0, 0, 0.01)
    assert model.fit is None  # many steps, but all of one shape say nothing about b or c


def test_window_forgets_old_steps():
    model = StepTimeModel(window=4, refit_every=1)
    shapes = [(1, 0), (2, 0), (3, 0), (4, 0), (1, 100), (2, 300), (3, 200), (4, 400)]
    for rows, tokens in shapes:
        model.observe(rows, tokens, 0, 1.0)  # a machine that took 1 s a step...
    for rows, tokens in shapes:
        model.observe(rows, tokens, 0, 0.5 + 0.01 * rows + 0.001 * tokens)  # ...then got faster
    assert astuple(model.fit) == pytest.approx((0.5, 0.01, 0.001, 0.0))


def test_decode_steps_do_not_push_out_what_a_prompt_token_costs():
    model = StepTimeModel(window=4, refit_every=1)
    for rows, tokens in [(1, 100), (2, 300), (3, 200), (4, 400)]:
        model.observe(rows, tokens, 0, 0.5 + 0.01 * rows + 0.001 * tokens)
    for _ in range(50):
        for rows in (1, 2, 3):
            model.observe(rows, 0, 0, 0.5 + 0.01 * rows)
    assert model.fit.c == pytest.approx(0.001)


def test_prefill_cap_and_prefill_time():
    fit = StepTimeFit(a=0.010, b=0.0001, c=0.00002)
    # 40 ms budget, 100 decodes: 40 - 10 - 10 = 20 ms for prompt tokens at 20 us each
    assert fit.max_prefill_tokens(100, 0.040) == 1000
    assert fit.max_prefill_tokens(400, 0.040) == 0  # the decodes alone take 50 ms
    # 2500 prompt tokens in chunks of 1000 beside 100 decodes: 2 full steps of 40 ms, one of 30 ms
    assert fit.prefill_seconds(2500, 100, 1000) == pytest.approx(0.110)


def test_decode_rows_a_step_budget_holds():
    fit = StepTimeFit(a=0.010, b=0.0001, c=0.00002)
    assert fit.max_decode_rows(0.045) == 350  # (45 - 10) ms at 0.1 ms a row
    assert fit.max_decode_rows(0.005) == 0  # the step alone takes longer
    assert StepTimeFit(a=0.010, b=0.0, c=0.0).max_decode_rows(0.045) == 1 << 30  # rows cost nothing measurable


@pytest.mark.slow  # runs the embedded engine; the fast tier checks the fit on given steps (tests above)
def test_the_engine_fits_its_own_steps():
    """Prompts of several lengths and their decodes: the engine feeds every step, and the fit it
    publishes predicts a positive time for a step (its intercept alone may come out 0 on a loaded
    machine: the timings are the machine's, so nothing finer is asserted)."""
    from goodserve import LLM, SamplingParams

    llm = LLM("dummy:tiny", device="cpu", scheduler_policy="slo", max_num_batched_tokens=64)
    prompts = [[5] * n for n in (3, 40, 90, 7, 150, 20)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, ignore_eos=True))
    model = llm.engine.scheduler.step_time
    assert model.fit is not None and model.fit.seconds(1, 150) > 0
    assert len(model.decode_steps) + len(model.mixed_steps) == llm.engine.steps.num_steps
    assert llm.engine.scheduler.forecast().fit == model.fit


def test_fit_recovers_the_context_term():
    """Steps whose decode rows read contexts of many lengths: the fit tells what a row costs (b) from
    what a token of its K/V costs (d)."""
    model = StepTimeModel(refit_every=1)
    for rows, tokens, context in [(1, 0, 100), (8, 0, 8000), (8, 512, 800), (32, 256, 64_000), (4, 1024, 400),
                                  (16, 0, 1600), (2, 2048, 10_000), (64, 128, 6400), (32, 0, 3200)]:
        model.observe(rows, tokens, context, 0.005 + 0.0001 * rows + 0.00002 * tokens + 4e-8 * context)
    assert astuple(model.fit) == pytest.approx((0.005, 0.0001, 0.00002, 4e-8))


def test_the_roofline_prior_tells_rows_from_context_where_the_steps_cannot():
    """Every row reads 500 tokens: the steps say only what a row and its context cost together
    (0.1 ms + 500 d). The prior holds d at a x kv_read_ratio; b is the rest."""
    model = StepTimeModel(refit_every=1, kv_read_ratio=1e-5)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        model.observe(rows, 0, 500 * rows, 0.005 + 0.0001 * rows)
    fit = model.fit
    assert fit.d == pytest.approx(0.005 * 1e-5, rel=1e-3)
    assert fit.b == pytest.approx(0.0001 - 500 * fit.d, rel=1e-3)
    assert fit.seconds(100, 0, 50_000) == pytest.approx(0.015, rel=1e-3)


def test_the_roofline_prior_keeps_a_row_from_costing_nothing():
    """A batch that barely changes size (112-120 rows), its contexts growing, and step times that fall
    1.5 us a row as it grows (noise the narrow range cannot average out): alone, the solve puts b near
    0 (it is 30 us) and a takes its part, so a row looks free. The prior holds b near a x row_compute_ratio; the steps'
    mean time is predicted as well either way."""
    steps = [(rows, 400 * rows + 2000 * i) for i, rows in enumerate([112, 120, 114, 118, 116, 113, 119, 115, 117])]
    times = [0.008 + 30e-6 * rows + 2e-8 * context - 31.5e-6 * (rows - 116) for rows, context in steps]
    fits = {}
    for ratio in (0.0, 0.0034):
        model = StepTimeModel(refit_every=1, kv_read_ratio=2.5e-6, row_compute_ratio=ratio)
        for (rows, context), t in zip(steps, times):
            model.observe(rows, 0, context, t)
        fits[ratio] = model.fit
        mean_predicted = sum(model.fit.seconds(r, 0, k) for r, k in steps) / len(steps)
        assert mean_predicted == pytest.approx(sum(times) / len(times), rel=0.01)
    assert fits[0.0].b < 3e-6
    assert fits[0.0034].b == pytest.approx(0.0034 * fits[0.0034].a, rel=0.05)


def test_no_negative_cost_the_rest_refitted():
    """Steps that got faster with more context (noise, or a kernel switch): d is 0, not negative, and
    a and b are fitted to the steps without it."""
    model = StepTimeModel(refit_every=1)
    for rows, context in [(1, 900), (2, 800), (4, 700), (8, 600), (16, 500), (32, 400), (64, 300), (128, 200)]:
        model.observe(rows, 0, context, 0.005 + 0.0001 * rows - 1e-7 * context)
    assert model.fit.d == 0.0 and model.fit.a > 0 and model.fit.b > 0


def test_context_a_step_reads_is_its_decode_rows_lengths():
    """Two decodes at positions 99 and 9 (100 and 10 tokens read), one verifying 2 drafts at position
    49 (52), and a 30-token prompt chunk (its own attention is prompt compute, c)."""
    from goodserve.engine.seam.scheduler_output import SchedulerOutput
    from goodserve.engine.core.step_time_model import step_shape

    out = SchedulerOutput(seq_ids=["a", "b", "c", "p"], num_new_tokens=[1, 1, 3, 30],
                          num_computed_tokens=[99, 9, 49, 60], draft_token_ids={2: [5, 6]})
    assert step_shape(out) == (3, 30, 100 + 10 + 52)


def test_relative_error_grows_with_mispredicted_steps():
    """Steps on the line the fit found: no error. Steps 50% slower than it says (a machine that got
    slower, not refitted yet): the error climbs to 0.5."""
    model = StepTimeModel(refit_every=1000)
    shapes = [(1, 0, 10), (8, 0, 800), (8, 512, 80), (32, 256, 640), (4, 1024, 40), (16, 0, 3200)] * 4
    for rows, tokens, context in shapes:
        model.observe(rows, tokens, context, 0.005 + 0.0001 * rows + 0.00002 * tokens + 1e-6 * context)
    assert model.relative_error == pytest.approx(0.0, abs=1e-9)
    for rows, tokens, context in shapes * 5:
        model.observe(rows, tokens, context, 1.5 * (0.005 + 0.0001 * rows + 0.00002 * tokens + 1e-6 * context))
    assert model.relative_error == pytest.approx(0.5, abs=0.01)
