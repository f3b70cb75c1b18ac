from doracheck.cli.main import main

raise SystemExit(main())
