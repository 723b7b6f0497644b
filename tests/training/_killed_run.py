"""Run by tests: linearformers-train that kills itself with SIGKILL in the middle of writing the checkpoint named by
argv[1] (after Trainer has written its model and optimizer, before the RNG states and trainer_state.json)."""

import os
import signal
import sys

from transformers import Trainer

from linearformers.training.__main__ import main

if __name__ == "__main__":
    target = sys.argv[1]
    save_rng_state = Trainer._save_rng_state

    def killed_while_saving(self, output_dir):
        if os.path.basename(output_dir) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        save_rng_state(self, output_dir)

    Trainer._save_rng_state = killed_while_saving
    sys.exit(main(sys.argv[2:]))
