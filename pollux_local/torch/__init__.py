"""pollux_local.torch: elastic, goodput-tuned data-parallel training inside a ``train.py``.

This is the only part of pollux-local that imports torch.  Porting a DDP script::

    from pollux_local.torch import ElasticTrainer

    trainer = ElasticTrainer(model, optimizer, base_batch=64, max_batch=1024)
    loader = trainer.loader(train_set)
    for epoch in trainer.epochs(num_epochs):
        for x, y in loader:
            trainer.step(loss_fn(trainer.model(x.to(trainer.device)), y.to(trainer.device)))
    trainer.close()

See ``trainer.py`` for what happens underneath, ``docs/architecture.md`` for the launch
environment and the job report.
"""

from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.spec import Target
from pollux_local.api.states import ExitCode
from pollux_local.jobspec import TrainingSpec, load_training_spec
from pollux_local.torch.checkpoint import CheckpointStore
from pollux_local.torch.env import init_distributed, job_environment, torch_device
from pollux_local.torch.gradstats import GradNoiseEstimator, two_batch_estimate
from pollux_local.torch.loader import ElasticLoader
from pollux_local.torch.sampler import ElasticSampler, StepPlan
from pollux_local.torch.trainer import ElasticTrainer

#: The exit code of a replica that checkpointed for a rescale (``ExitCode.RESCALE``), by the
#: name job scripts use.
RESCALE_EXIT_CODE = ExitCode.RESCALE

__all__ = [
    "RESCALE_EXIT_CODE",
    "CheckpointStore",
    "ElasticLoader",
    "ElasticSampler",
    "ElasticTrainer",
    "GradNoiseEstimator",
    "LaunchEnvironment",
    "StepPlan",
    "Target",
    "TrainingSpec",
    "init_distributed",
    "job_environment",
    "load_training_spec",
    "torch_device",
    "two_batch_estimate",
]
