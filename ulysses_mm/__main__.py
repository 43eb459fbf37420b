from ulysses_mm.cli import main

raise SystemExit(main())
