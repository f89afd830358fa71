"""Run dir: a run's folder from start to finish. Durable writes (`atomic.py`), one run per folder and what an
earlier run left (`lock.py`), which run the same command resumes (`resume.py`), the files a run leaves beside its
adapter and what a launch on bad input takes back (`files.py`), and the fingerprints of the inputs a resume must
find unchanged (`fingerprint.py`).

May import: glmtune.config, glmtune.launch. The stages below write through `atomic.py`.
"""
