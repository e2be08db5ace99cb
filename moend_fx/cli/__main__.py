import sys

from moend_fx.cli import main

sys.exit(main())
