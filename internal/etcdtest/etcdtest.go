// Package etcdtest starts a real in-process etcd (internal/embedetcd) for a
// test and writes keys to it.
package etcdtest

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/internal/embedetcd"
)

// Timeout bounds each request a test makes.
const Timeout = 30 * time.Second

// Delete, as a value to Put, deletes the key.
const Delete = "<delete>"

// Start starts an etcd member with its data in a temporary directory of tb,
// and a client of it; both are stopped when the test ends.
func Start(tb testing.TB) (*embedetcd.Server, *clientv3.Client) {
	tb.Helper()
	srv, err := embedetcd.Start(filepath.Join(tb.TempDir(), "etcd"), embedetcd.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(srv.Stop)
	cli, err := srv.Client()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cli.Close() })
	return srv, cli
}

// Put writes key/value pairs in one transaction; a value of Delete deletes
// its key.
func Put(tb testing.TB, cli *clientv3.Client, kv ...string) {
	tb.Helper()
	ops := make([]clientv3.Op, 0, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] == Delete {
			ops = append(ops, clientv3.OpDelete(kv[i]))
		} else {
			ops = append(ops, clientv3.OpPut(kv[i], kv[i+1]))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
		tb.Fatal(err)
	}
}
