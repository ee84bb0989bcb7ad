"""A pipeline's micro-step played op by op (common/parallel/pipeline_timing.py), against what can be worked out by
hand for each schedule: the bubble without sends, the messages one after another without compute, and the sends
a schedule hides behind its pieces."""
import pytest

from common.parallel.pipeline import SCHEDULES
from common.parallel.pipeline_timing import micro_step_s


def waits(schedule, stages, micro, f, b, send):
    return micro_step_s(schedule, stages, micro, f, b, [send] * (stages - 1)) - \
        micro_step_s(schedule, stages, micro, f, b, [0.0] * (stages - 1))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages, micro", [(2, 4), (3, 4), (4, 8), (5, 5)])
def test_without_sends_a_micro_step_is_m_plus_p_minus_1_slots(schedule, stages, micro):
    assert micro_step_s(schedule, stages, micro, 0.25, 0.5, [0.0] * (stages - 1)) == \
        pytest.approx((micro + stages - 1) * 0.75)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("micro", [1, 2, 4, 7])
def test_without_compute_two_stages_cross_every_message_one_after_another(schedule, micro):
    # 1f1b: a piece's gradient leaves the last stage after the next activation arrives (pipeline.py's order);
    # gpipe: every activation down, then every gradient up
    assert micro_step_s(schedule, 2, micro, 0.0, 0.0, [1.0]) == pytest.approx(2 * micro)


@pytest.mark.parametrize("micro", [1, 2, 4, 7])
def test_without_compute_torch_order_crosses_each_gradient_beside_the_next_activation(micro):
    # the hop's two directions at once: M + 1 messages' time under 1f1b; gpipe still sends all down, then up
    assert micro_step_s("1f1b", 2, micro, 0.0, 0.0, [1.0], batched=True) == pytest.approx(micro + 1)
    assert micro_step_s("gpipe", 2, micro, 0.0, 0.0, [1.0], batched=True) == pytest.approx(2 * micro)


@pytest.mark.parametrize("micro", [2, 4, 6])
def test_sends_shorter_than_a_piece_wait_twice_under_gpipe_and_2m_minus_2_times_under_1f1b(micro):
    # gpipe streams every activation behind the next forward: only the first and the last message wait
    assert waits("gpipe", 2, micro, 1.0, 1.0, 0.5) == pytest.approx(2 * 0.5)
    # 1f1b over two stages keeps one piece in flight: all but one message each way wait
    assert waits("1f1b", 2, micro, 1.0, 1.0, 0.5) == pytest.approx((2 * micro - 2) * 0.5)
    assert waits("1f1b", 2, micro, 2.0, 2.0, 0.5) == pytest.approx((2 * micro - 2) * 0.5)  # whatever the compute


def test_each_boundary_pays_its_own_link_and_a_slow_middle_hop_costs_less_than_three():
    fast, slow = 0.01, 1.0
    one_slow = micro_step_s("1f1b", 4, 8, 0.25, 0.5, [fast, slow, fast])
    assert micro_step_s("1f1b", 4, 8, 0.25, 0.5, [fast] * 3) < one_slow < micro_step_s("1f1b", 4, 8, 0.25, 0.5, [slow] * 3)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_finishes_at_every_size(schedule):
    for stages in range(2, 7):
        for micro in range(1, 10):
            if schedule == "1f1b" and micro < stages:
                continue  # RunConfig refuses it (torch's schedules need a micro-batch per stage)
            t = micro_step_s(schedule, stages, micro, 0.1, 0.2, [0.05 * (b + 1) for b in range(stages - 1)])
            assert t >= (micro + stages - 1) * 0.3 - 1e-12


@pytest.mark.parametrize("micro", [2, 4, 8])
def test_torch_posting_a_gradient_with_the_next_receive_waits_one_send_per_piece(micro):
    """torch's Schedule1F1B posts the last stage's gradient send with its next activation receive (batched,
    non-blocking): the gradient leaves as soon as its backward ends, so over two stages sends shorter than a
    piece cost M of them, against 2M - 2 in MLX's order, which receives the next activation first."""
    assert waits("1f1b", 2, micro, 1.0, 1.0, 0.5) == pytest.approx((2 * micro - 2) * 0.5)
    batched = micro_step_s("1f1b", 2, micro, 1.0, 1.0, [0.5], batched=True) - \
        micro_step_s("1f1b", 2, micro, 1.0, 1.0, [0.0], batched=True)
    assert batched == pytest.approx(micro * 0.5)


def test_rendezvous_sends_deadlock_in_torch_order_and_never_in_stage_ops_order():
    """Why stage_ops swaps a gradient send after the next activation receive: were every send a rendezvous
    (messages beyond the socket buffers), torch's order, posted one operation at a time, would deadlock."""
    with pytest.raises(RuntimeError, match="deadlocked"):
        micro_step_s("1f1b", 2, 4, 1.0, 2.0, [0.0], batched=True, rendezvous=True)
    assert micro_step_s("1f1b", 2, 4, 1.0, 2.0, [0.0], rendezvous=True) == pytest.approx(5 * 3.0)


def test_a_rendezvous_send_holds_its_sender_until_the_receive_is_posted_not_until_the_message_has_crossed():
    """Open MPI holds a message past its eager limit until the receiver posts, then the sender goes on while the
    rest crosses from the socket's buffer. 1f1b over 2 stages, 2 pieces, F 1 s, B 2 s, a message 3 s: stage 0
    sends activation 1 at 7 s (stage 1 posts its receive after its first backward), goes on at once, and ends at
    20 s, where held until the message had crossed (10 s) it ended at 21; buffered, 15."""
    assert micro_step_s("1f1b", 2, 2, 1.0, 2.0, [3.0], rendezvous=True) == pytest.approx(20.0)
    assert micro_step_s("1f1b", 2, 2, 1.0, 2.0, [3.0]) == pytest.approx(15.0)
