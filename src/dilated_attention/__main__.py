"""``python -m dilated_attention``: the ``dilated-attention`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
