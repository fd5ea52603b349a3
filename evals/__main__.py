"""`python -m evals <command>`: false-hits (the semantic cache's regression gate), risk (the personal-data
rule), calibrate (the semantic layer's false-hit calibration)."""

import sys

from .calibrate import main as calibrate
from .false_hits import main as false_hits
from .risk import main as risk

COMMANDS = {"false-hits": false_hits, "risk": risk, "calibrate": calibrate}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m evals {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
