"""Lesson 12, resuming on another number of ranks (helpers.checkpoints_and_failures.resize),
keeping the last k checkpoints (resume.keep_last) and how often to save (interval): a job saved
by FSDP on 4 ranks, its data position one count of samples, resumes on 2 and equals one process
that trained every step on the whole global batch.

The comparison with one process is in float64, at torch.testing.assert_close's float64
tolerance (rtol 1e-7, atol 1e-7): the ranks' sums of the same terms in another order move a loss
or a weight by tens of float64 epsilons (2**-52 = 2.2e-16) over these 8 AdamW steps, and a wrong
sample, or a step's sample twice, moves the loss in its first digits. The rest are counts and
formulas: the file is not marked numerical."""

import math
import os

import torch

from helpers import reference, run
from helpers.checkpoints_and_failures import interval, resize, resume


def test_each_step_is_the_same_global_batch_on_any_number_of_ranks():
    job = resize.GlobalBatchJob()
    for consumed in (0, 8, 32, 40):  # the first two steps of the first two epochs
        whole = job.samples(consumed, 0, 1)
        for world_size in (2, 4, 8):
            shares = [job.samples(consumed, rank, world_size) for rank in range(world_size)]
            assert [sample for share in shares for sample in share] == whole
        whole_batch = job.batch(consumed, 0, 1)
        halves = [job.batch(consumed, rank, 2) for rank in range(2)]
        assert torch.equal(torch.cat([half.inputs for half in halves]), whole_batch.inputs)
    # an epoch (4 steps) sees every sequence once
    assert sorted(index for step in range(4) for index, _ in job.samples(8 * step, 0, 1)) == \
        list(range(32))


def test_a_job_saved_on_4_ranks_resumes_on_2_and_equals_one_process(tmp_path):
    job = resize.GlobalBatchJob()
    first = run(resize.resized_worker, 4, args=(job, str(tmp_path)), kwargs={"stop_after": 4},
                show_output=False)[0]
    second = run(resize.resized_worker, 2, args=(job, str(tmp_path)), show_output=False)[0]
    assert (first["started after"], sorted(first["losses"])) == (0, [1, 2, 3, 4])
    assert (second["started after"], sorted(second["losses"])) == (4, [5, 6, 7, 8])
    alone = reference.train(job.model(), resize.global_batches(job), reference.lm_loss)
    torch.testing.assert_close({**first["losses"], **second["losses"]}, alone.losses_by_step())
    torch.testing.assert_close(second["state"]["model"], alone.parameters)
    # a save every 2 steps, the newest 2 kept: the 2-rank run removed the 4-rank run's
    assert (first["removed"], second["removed"]) == ([], [2, 4])
    assert sorted(os.listdir(tmp_path)) == ["step-0006", "step-0008"]
    assert len(first["save seconds"]) == len(second["save seconds"]) == 2


def test_keep_last_removes_older_and_cut_off_checkpoints_but_not_a_save_in_progress(tmp_path):
    complete = {1, 2, 4, 6}
    for step in range(1, 8):  # 3 and 5 were cut off; 7 is still being written
        os.makedirs(resume.checkpoint_path(str(tmp_path), step))
        if step in complete:
            (tmp_path / f"step-{step:04d}" / ".metadata").write_bytes(b"")
    assert resume.keep_last(str(tmp_path), 2) == [1, 2, 3, 5]
    assert sorted(os.listdir(tmp_path)) == ["step-0004", "step-0006", "step-0007"]
    assert resume.keep_last(str(tmp_path), 2) == []
    assert resume.keep_last(str(tmp_path), 1) == [4]


def test_youngs_interval_minimises_the_first_order_lost_time():
    for save_s, mtbf_s in ((0.1, interval.LLAMA3_MTBF_S), (300.0, interval.LLAMA3_MTBF_S),
                           (60.0, 86400.0)):
        best = interval.young_interval(save_s, mtbf_s)
        lost = interval.lost_fraction(best, save_s, mtbf_s)
        assert math.isclose(lost, math.sqrt(2 * save_s / mtbf_s), rel_tol=1e-12)
        assert lost < interval.lost_fraction(best * 0.99, save_s, mtbf_s)
        assert lost < interval.lost_fraction(best * 1.01, save_s, mtbf_s)
    # Daly's Fig. 3 case: Young's formula gives 120 min, his higher-order model 117 min
    assert interval.young_interval(interval.DALY_FIG3_SAVE_MIN,
                                   interval.DALY_FIG3_MTBF_MIN) == 120.0
    # the lesson's quoted MTBF: 54 days, 419 interruptions, 3.1 hours
    assert round(interval.LLAMA3_MTBF_S / 3600, 1) == 3.1
