import sys

from metaps.cli import main

sys.exit(main())
