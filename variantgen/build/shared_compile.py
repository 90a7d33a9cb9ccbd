"""``python -m variantgen.build.shared_compile``: what a module's build.ninja runs for a shared kernel
unit - objects.main (compile it into the object cache once, copy its object to the build).
A module of its own, imported by nothing, so that running it does not import it twice."""

import sys

from .objects import main

if __name__ == "__main__":
    sys.exit(main())
