"""Run dir: a run's folder from start to finish. Durable writes (`atomic.py`), one run per folder and what an
earlier run left (`lock.py`), which run the same command resumes (`resume.py`), and the files a run leaves beside
its adapter, with the console's error line (`files.py`).

May import: glmtune.config, glmtune.launch. The stages below write through `atomic.py`.
"""
