"""``python -m tenplex``: the ``tenplex`` command (so ``torchrun -m tenplex reshard ...`` works)."""

from tenplex.cli.main import run

if __name__ == "__main__":
    run()
