"""The step-time model: least squares over measured steps, and what the scheduler reads from it."""

from dataclasses import astuple

import pytest

from goodserve.engine.step_time_model import MIN_STEPS, StepTimeFit, StepTimeModel


def test_fit_recovers_the_line_the_steps_lie_on():
    model = StepTimeModel(refit_every=1)
    shapes = [(1, 0), (8, 0), (8, 512), (32, 256), (4, 1024), (16, 0), (2, 2048), (64, 128)]
    for rows, tokens in shapes:
        model.observe(rows, tokens, 0.005 + 0.0001 * rows + 0.00002 * tokens)
    assert astuple(model.fit) == pytest.approx((0.005, 0.0001, 0.00002))


def test_fit_by_hand_on_noisy_steps():
    """Four steps, solved by hand: the normal equations of t = a + b rows + c tokens on
    (0,0,1.0) (1,0,2.0) (0,1,3.0) (1,1,5.0) give a = 0.75, b = 1.5, c = 2.5 (residuals +-0.25)."""
    model = StepTimeModel(refit_every=1)
    for rows, tokens, t in [(0, 0, 1.0), (1, 0, 2.0), (0, 1, 3.0), (1, 1, 5.0)] * 2:
        model.observe(rows, tokens, t)
    assert (model.fit.a, model.fit.b, model.fit.c) == pytest.approx((0.75, 1.5, 2.5))


def test_no_fit_from_too_few_steps_or_one_shape():
    model = StepTimeModel(refit_every=1)
    for _ in range(MIN_STEPS - 1):
        model.observe(8, 0, 0.01)
    assert model.fit is None
    model.observe(8, 0, 0.01)
    assert model.fit is None  # many steps, but all of one shape say nothing about b or c


def test_window_forgets_old_steps():
    model = StepTimeModel(window=4, refit_every=1)
    shapes = [(1, 0), (2, 0), (3, 0), (4, 0), (1, 100), (2, 300), (3, 200), (4, 400)]
    for rows, tokens in shapes:
        model.observe(rows, tokens, 1.0)  # a machine that took 1 s a step...
    for rows, tokens in shapes:
        model.observe(rows, tokens, 0.5 + 0.01 * rows + 0.001 * tokens)  # ...then got faster
    assert astuple(model.fit) == pytest.approx((0.5, 0.01, 0.001))


def test_decode_steps_do_not_push_out_what_a_prompt_token_costs():
    model = StepTimeModel(window=4, refit_every=1)
    for rows, tokens in [(1, 100), (2, 300), (3, 200), (4, 400)]:
        model.observe(rows, tokens, 0.5 + 0.01 * rows + 0.001 * tokens)
    for _ in range(50):
        for rows in (1, 2, 3):
            model.observe(rows, 0, 0.5 + 0.01 * rows)
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
