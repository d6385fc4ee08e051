"""`python -m hybrid_compile` is the `hybrid-compile` command line."""

from .cli import main

raise SystemExit(main())
