"""The profile job: a short Ray Train job that measures, on the cluster itself, what a model's
parts cost to compute and hold and what the cluster's links cost.

* `raylane.profile.job`: the job on Ray Train, its MLflow run and its reuse;
* `raylane.profile.worker`: what each worker measures, and the profile it returns;
* `raylane.profile.layouts`: the strategies' own code timed (wrapped blocks, the parameter
  server, the pipeline schedules, DDP);
* `raylane.profile.links`: the all-reduce and point-to-point links.

The planner reads the profile back without torch (`raylane.plan.measured`, its fits
`raylane.plan.fits` and the wrapped blocks' names `raylane.plan.wrapped`).
"""
