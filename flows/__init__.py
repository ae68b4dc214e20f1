"""One Prefect flow per DVC stage (`python -m flows.<stage>`), plus the scheduled pipeline."""

import os

STARTED_BY = os.getppid()  # the parent at start-up, before any slow import (flows._stage: a stage ends with DVC)
