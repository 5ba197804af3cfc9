from kvmetal.cli import main
import sys
sys.exit(main())
