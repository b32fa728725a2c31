from minivllm.bench import main

raise SystemExit(main())
