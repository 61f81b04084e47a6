// Command etcd is a thin wrapper around etcd's own entry point. etcd's server module carries
// replace directives, so `go install` refuses it; requiring it from this module builds it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
