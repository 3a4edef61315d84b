from offload.commands.cli import main

raise SystemExit(main())
