"""``python -m variantgen``: the command line (variantgen.tools.cli)."""

from .tools.cli import main

if __name__ == "__main__":
    main()
