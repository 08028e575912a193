import sys

from fp4rl.cli import main

sys.exit(main())
