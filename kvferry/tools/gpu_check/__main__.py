import sys

from kvferry.tools.gpu_check.driver import main

sys.exit(main())
