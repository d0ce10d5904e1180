import sys

from services.controller.server import main

sys.exit(main())
