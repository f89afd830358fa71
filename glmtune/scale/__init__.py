"""Scale out: the objects a cluster needs to run a plan. `mode=plan plan.emit=trainjob` writes a Kubeflow Trainer v2
TrainJob and its ClusterTrainingRuntime (`trainjob.py`), whose resources per node are the plan's and whose grace
period covers the step in flight and one complete checkpoint (`grace.py`).

May import: glmtune.config, launch, rundir, models, plan, train. Imported by the modes (glmtune/modes/).
"""
