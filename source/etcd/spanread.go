package etcd

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/kvset"
)

// Reading many members in one range. A group of a thousand members read
// one prefix each is a thousand range requests; etcd spends on each what a
// request costs (a read transaction, a response header, a gRPC message)
// and the worker as much again. Members whose prefixes sort next to each
// other are read instead as one span: the keys from the first one's prefix
// to the end of the last one's, in pages at one revision, each key routed
// to the members whose prefix it has. Measured on one member with 1,000
// prefixes of 100 small keys (issue 37), 16 reads at once: 1,000 requests
// took 248–357 ms and 280–410 ms of etcd's CPU, 20 ranges of 50 prefixes
// 114–161 ms and 130–220 ms (BENCHMARKS.md, "A group read in spans").
//
// A span holds keys of no member — those that sort between two members'
// prefixes — and reads them for nothing. So a span gives up once it has
// read more of them than nonMemberKeys or nonMemberBytes, and so does one
// whose page etcd cannot send within its budget (large values): its
// members not read yet are then read on their own, as before, by
// listPrefix, which knows how to read large values and to refuse a prefix
// of too many keys by its count. A span that etcd's authorization refuses
// (a user granted each prefix alone) is read so too, and so is every
// prefix of the source from then on (Source.spansRefused).

// spanMembers is the most members one span covers.
const spanMembers = 64

// A span read stops once it has read more than nonMemberKeys keys, or
// more than nonMemberBytes bytes of keys and values, that no member of it
// takes (keys of none, or of a member held over its limits).
const (
	nonMemberKeys  = 1000
	nonMemberBytes = 1 << 20
)

// errSpanAbandoned ends a span read that read too much for none of its
// members, met a page larger than its budget, or was refused for want of
// permission (errSpanRefused).
var errSpanAbandoned = errors.New("span read abandoned")

// errSpanRefused is etcd's refusal of a span's range for want of
// permission: a user granted each prefix alone (a role per prefix) may
// read no range across them.
var errSpanRefused = errors.New("etcd refuses a read across the mounts' prefixes (authorization)")

// spans splits ms, sorted by prefix, into runs of at most per members
// (at least one) whose prefixes are read together; a member whose prefix
// is inside the run's range stays in the run whatever its size, so that
// each member is in one run and every key of a run's members is in its
// range.
func spans(ms []*member, per int) [][]*member {
	per = max(per, 1)
	var out [][]*member
	for i := 0; i < len(ms); {
		j, end := i+1, rangeEnd(ms[i].prefix)
		for j < len(ms) && (j-i < per || inRange(ms[j].prefix, end)) {
			end = maxEnd(end, rangeEnd(ms[j].prefix))
			j++
		}
		out = append(out, ms[i:j])
		i = j
	}
	return out
}

// rangeEnd is the end of prefix's key range, "\x00" meaning no end (the
// empty prefix), as etcd takes it; see span.
func rangeEnd(prefix string) string {
	_, end := span(prefix)
	return end
}

// inRange reports whether key sorts before end ("\x00": no end). A
// prefix sorted after p is in p's range exactly when it starts with p.
func inRange(key, end string) bool { return end == "\x00" || key < end }

// max of two range ends, "\x00" (no end) being the largest.
func maxEnd(a, b string) string {
	if a == "\x00" || b == "\x00" {
		return "\x00"
	}
	return max(a, b)
}

// spanState is what a span read keeps for each of its members.
type spanState struct {
	m         *member
	end       string
	entries   *kvset.Builder
	oversized map[string]int64
	kept      int64
	done      bool // emitted or held
}

// readSpan reads the prefixes of ms (a run from spans, sorted) in one
// range at rev (0: the latest, which its first page pins), and emits each
// member's read as soon as the pages have passed its prefix. check is
// given the first page's header, unless nil, before anything is emitted;
// an error from it ends the read. A member over its limits is held
// (Source.hold) once a page takes it past them, and emits nothing. When
// the span gives up (errSpanAbandoned: too many keys of no member, or a
// page over its budget) it returns the members it has neither emitted nor
// held, to be read on their own; otherwise it returns none. A compacted
// rev is a resync.
func (s *Source) readSpan(ctx context.Context, cli *clientv3.Client, ms []*member, rev int64, check func(*etcdserverpb.ResponseHeader) error, emit func(memberRead)) (rest []*member, err error) {
	states := make([]*spanState, len(ms))
	byPrefix := make(map[string][]*spanState, len(ms))
	var lengths []int
	start, end := span(ms[0].prefix)
	budget := pageBudget
	for i, m := range ms {
		st := &spanState{m: m, end: rangeEnd(m.prefix), entries: &kvset.Builder{}}
		states[i] = st
		byPrefix[m.prefix] = append(byPrefix[m.prefix], st)
		end = maxEnd(end, st.end)
		lengths = append(lengths, len(m.prefix))
		if m.pub.Limits().MaxValueSize == 0 {
			budget = maxRecvMsgSize // values unbounded: as listPrefix reads them
		}
	}
	slices.Sort(lengths)
	lengths = slices.Compact(lengths)
	r := pageReader{kv: clientv3.RetryKVClient(cli), prefix: start, start: start, end: end, rev: rev, page: pageSize, safe: pageSize, budget: budget}
	var header *etcdserverpb.ResponseHeader
	var strayKeys, strayBytes int
	unfinished := func() []*member {
		var out []*member
		for _, st := range states {
			if !st.done {
				out = append(out, st.m)
			}
		}
		return out
	}
	key := start
	for {
		resp, err := r.read(ctx, key)
		switch {
		case errors.Is(err, errPageTooLarge):
			return unfinished(), fmt.Errorf("%w: %w", errSpanAbandoned, err)
		case err != nil && permissionDenied(err):
			return unfinished(), fmt.Errorf("%w: %w: %w", errSpanAbandoned, errSpanRefused, err)
		case errors.Is(err, rpctypes.ErrCompacted):
			return nil, fmt.Errorf("%w: revision compacted during read", errResync)
		case err != nil:
			return nil, fmt.Errorf("source/etcd: read %s…%s: %w", start, ms[len(ms)-1].prefix, err)
		}
		if header == nil {
			header = resp.Header
			if check != nil {
				if err := check(header); err != nil {
					return nil, err
				}
			}
		}
		// Each member's keys of the page, in order.
		page := map[*spanState][]*mvccpb.KeyValue{}
		for _, kv := range resp.Kvs {
			taken := false
			for _, n := range lengths {
				if n > len(kv.Key) {
					break
				}
				for _, st := range byPrefix[string(kv.Key[:n])] { // no copy: a map index
					if !st.done {
						page[st] = append(page[st], kv)
						taken = true
					}
				}
			}
			if !taken {
				strayKeys++
				strayBytes += len(kv.Key) + len(kv.Value)
			}
		}
		for st, kvs := range page {
			lim := st.m.pub.Limits()
			st.kept += addPacked(st.entries, &st.oversized, st.m.prefix, kvs, lim)
			if err := lim.Check(st.entries.Len()+len(st.oversized), st.kept); err != nil {
				s.hold(st.m, fmt.Errorf("source/etcd: %s: %w", st.m.prefix, err))
				st.done, st.entries, st.oversized = true, nil, nil
			}
		}
		more := resp.More && len(resp.Kvs) > 0
		var last string
		if more {
			last = string(resp.Kvs[len(resp.Kvs)-1].Key)
		}
		// A member whose range the pages have passed is complete.
		for _, st := range states {
			if !st.done && (!more || !inRange(last, st.end)) {
				st.done = true
				emit(memberRead{m: st.m, entries: st.entries.Set(), oversized: st.oversized, header: header})
			}
		}
		if !more {
			return nil, nil
		}
		if strayKeys > nonMemberKeys || strayBytes > nonMemberBytes {
			return unfinished(), fmt.Errorf("%w: %d keys (%d bytes) of no mount's prefix between %s and %s", errSpanAbandoned, strayKeys, strayBytes, start, ms[len(ms)-1].prefix)
		}
		if testHookAfterPage != nil {
			testHookAfterPage()
		}
		key = last + "\x00"
	}
}
