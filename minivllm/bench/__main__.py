from minivllm.bench.cli import main

raise SystemExit(main())
