"""``python -m dilated_attention``: the ``dilated-attention`` command."""

from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
