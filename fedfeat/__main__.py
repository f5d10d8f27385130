"""``python -m fedfeat ...`` (also what ``torchrun -m fedfeat encode ...`` runs)."""

from fedfeat.cli import main

if __name__ == "__main__":
    main()
