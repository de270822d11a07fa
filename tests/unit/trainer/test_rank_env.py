"""Where a trainer rank learns its place: torchrun's (or our launcher's) variables, else srun's, else alone."""

from services.trainer.distributed import RankInfo, rank_from_env


def test_torchrun_and_launcher_variables_win():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
    assert rank_from_env(env) == RankInfo(3, 4, 1)


def test_srun_tasks_are_ranks_and_a_single_task_is_alone():
    assert rank_from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}) == RankInfo(5, 8, 1)
    assert rank_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert rank_from_env({}) is None
