package consul

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/source"
)

// discardPublisher drops what it is handed.
type discardPublisher struct{}

func (discardPublisher) Publish(source.Snapshot) {}
func (discardPublisher) Status(error)            {}
func (discardPublisher) Limits() source.Limits   { return source.Limits{} }

// BenchmarkSplit measures how a group's response is handed to its
// followers after a change: 1,000 prefixes of one key each in one group,
// one key changed per response (its follower publishes, the others find
// their range unchanged). Run with:
// go test -run '^$' -bench Split ./source/consul
func BenchmarkSplit(b *testing.B) {
	const n = 1000
	s, err := New("main", watchConfig("127.0.0.1:1"), sourcetest.Discard)
	if err != nil {
		b.Fatal(err)
	}
	pairs := make(api.KVPairs, n)
	for i := range n {
		prefix := fmt.Sprintf("many/p%04d/", i)
		s.followers = append(s.followers, &follower{prefix: prefix, pub: discardPublisher{}})
		pairs[i] = &api.KVPair{Key: prefix + "key", Value: []byte(strconv.Itoa(i)), ModifyIndex: 10}
	}
	s.groups = []string{"many/p0"}
	s.set(&listing{parent: "many/p0", pairs: pairs, index: 10})
	index := uint64(10)
	for b.Loop() {
		index++
		changed := *pairs[n-1]
		changed.ModifyIndex = index
		next := append(api.KVPairs(nil), pairs[:n-1]...)
		next = append(next, &changed)
		s.set(&listing{parent: "many/p0", pairs: next, index: index})
	}
}
