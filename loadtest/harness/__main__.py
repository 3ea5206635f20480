import sys

from loadtest.harness.run import main

sys.exit(main())
