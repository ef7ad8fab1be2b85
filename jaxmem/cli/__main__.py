import sys

from jaxmem.cli.app import main

sys.exit(main())
