import sys

from pollux_local.cli import main

sys.exit(main())
