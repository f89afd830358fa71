"""`python -m glmtune.supervise LAUNCHER ARGS...`: the command scripts/*.sh run torchrun and deepspeed under.

The supervisor itself is glmtune/launch/supervise.py; this name stays because it is the documented command.
"""

from glmtune.launch.supervise import main

if __name__ == "__main__":
    main()
